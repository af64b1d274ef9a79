"""The agent workload with tools: its requests, its history of calls and tool outputs, the
client's assembly of streamed calls, and the constrained-vs-free report."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from radixserve.bench.client import send_request
from radixserve.bench.report import RequestRecord
from radixserve.bench.tools import AGENT_TOOLS, agent_stats, format_agent, valid_call
from radixserve.bench.workloads import build_sessions, make_workload, script

SMALL = {"agents": "2", "steps": "4", "system_tokens": "128", "tool_tokens": "48"}


def call(name: str, args: object, cid: str = "c0") -> dict:
    arguments = args if isinstance(args, str) else json.dumps(args)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_every_agent_turn_sends_the_same_five_tools_and_alternates_required_and_auto(counter):
    w = make_workload("agent", SMALL)
    specs = script(build_sessions(w, 0, counter), "chat")
    assert len(specs) == 8 and len(AGENT_TOOLS) == 5
    for spec in specs:
        body = spec.body("m")
        assert body["tools"] == AGENT_TOOLS and body["parallel_tool_calls"] is False
        assert body["tool_choice"] == ("required" if spec.turn % 2 == 0 else "auto")


def test_a_tool_call_goes_back_as_an_assistant_call_and_a_tool_message_with_the_output(counter):
    s = build_sessions(make_workload("agent", SMALL), 0, counter)[0]
    c = call("read_file", {"path": "os.py"}, "call_7")
    s.record("", [c])
    msgs = s.next_request("chat").messages
    assert msgs[-2] == {"role": "assistant", "content": "", "tool_calls": [c]}
    assert msgs[-1] == {"role": "tool", "tool_call_id": "call_7", "content": s.inputs[1]}
    s.record("I will look elsewhere.")  # an answer without a call: the output comes as user text
    msgs = s.next_request("chat").messages
    assert msgs[-2:] == [
        {"role": "assistant", "content": "I will look elsewhere."},
        {"role": "user", "content": s.inputs[2]},
    ]


def test_completion_requests_of_the_agent_workload_carry_no_tools(counter):
    s = build_sessions(make_workload("agent", SMALL), 0, counter)[0]
    assert "tools" not in s.next_request("completion").body("m")


@pytest.mark.parametrize(
    "bad",
    [
        call("delete_everything", {"path": "x"}),
        call("read_file", "{not json"),
        call("read_file", ["os.py"]),
        call("read_file", {}),
        call("read_file", {"path": "x", "mode": "r"}),
        call("read_file", {"path": 3}),
        call("grep", {"pattern": "x", "max_matches": True}),
        call("grep", {"pattern": "x", "max_matches": 2.5}),
    ],
)
def test_a_call_off_the_schema_is_not_valid(bad):
    assert not valid_call(bad)


def test_calls_on_the_schema_are_valid():
    assert valid_call(call("read_file", {"path": "os.py"}))
    assert valid_call(call("grep", {"pattern": "def ", "path": "a.py", "max_matches": 3}))
    assert valid_call(call("write_file", {"path": "a", "content": "", "create": False}))


def test_the_client_puts_streamed_tool_call_deltas_together_and_times_them():
    deltas = [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "grep"}},
        {"index": 0, "function": {"arguments": '{"pattern": '}},
        {"index": 0, "function": {"arguments": '"x"}'}},
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
        chunks += [{"choices": [{"index": 0, "delta": {"tool_calls": [d]}}]} for d in deltas]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    s = build_sessions(make_workload("agent", SMALL), 0, None)[0]
    spec = s.next_request("chat")

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await send_request(c, "http://127.0.0.1:9", spec, spec.body("m"), 0.0)

    rec = asyncio.run(go())
    assert rec.tool_choice == "required" and rec.finish_reason == "tool_calls"
    assert rec.tool_calls == [call("grep", {"pattern": "x"}, "call_1")]
    assert rec.text == "" and rec.chunks == 3 and rec.ttft is not None


def record(turn: int, choice: str, tpot: float, calls: list[dict], cached: int) -> RequestRecord:
    r = RequestRecord(f"a-t{turn}", "a", turn, 0.0, ttft=0.1, e2e=0.1 + 9 * tpot)
    r.completion_tokens, r.prompt_tokens, r.cached_tokens = 10, 100, cached
    r.tool_choice, r.tool_calls = choice, calls
    return r


def test_agent_stats_compare_constrained_and_free_tokens_and_count_later_turn_hits():
    good, bad = call("run", {"cmd": "ls"}), call("run", {"command": "ls"})
    records = [
        record(0, "required", 0.011, [good], 0),
        record(1, "auto", 0.010, [], 95),
        record(2, "required", 0.011, [bad], 90),
        record(3, "auto", 0.010, [good], 100),
    ]
    stats = agent_stats(records)
    assert stats["constrained_tpot_overhead"] == pytest.approx(0.1)
    assert stats["required"]["valid_call_rate"] == 0.5 and stats["auto"]["with_calls"] == 1
    assert stats["later_turns"] == 3 and stats["later_turn_cache_hit_share"] == 0.95
    assert "+10.0% vs free decoding" in format_agent(stats)


def test_the_reusable_hit_share_leaves_out_each_turn_s_new_tool_output():
    first, second = record(0, "required", 0.01, [], 0), record(1, "auto", 0.01, [], 96)
    second.prompt_tokens = 300  # 110 from turn 0 (prompt + output), 190 new
    stats = agent_stats([first, second])
    assert stats["later_turn_cache_hit_share"] == pytest.approx(0.32)
    assert stats["later_turn_reusable_hit_share"] == pytest.approx(96 / 110)
    assert "(87.3% of the previous turn's prompt + output)" in format_agent(stats)


def test_agent_stats_without_auto_turns_report_no_overhead():
    stats = agent_stats([record(0, "required", 0.01, [], 0)])
    assert math.isnan(stats["constrained_tpot_overhead"]) and stats["later_turns"] == 0
    assert "cache hit share -" in format_agent(stats)
