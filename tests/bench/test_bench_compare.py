"""A/B comparison: sides alternate and never overlap; the suite report renders both sides."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex

import httpx
import pytest

from radixserve.bench.cli import add_bench_args
from radixserve.bench.corpus import TokenCounter
from radixserve.bench.load import BenchPlan, LoadConfig
from radixserve.bench.servers import ServerProcess
from radixserve.bench.suite import compare, suite_markdown, write_run_files
from radixserve.bench.workloads import make_workload

URLS = ("http://127.0.0.1:1", "http://127.0.0.1:2")


class TwoServers:
    """A fake OpenAI server per port; logs (port, event) so overlap would show."""

    def __init__(self, drafts_on_1: bool = False) -> None:
        self.events: list[tuple[int, str]] = []
        self.drafts_on_1 = drafts_on_1  # port 1 reports speculative drafts in its usage

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        port = request.url.port
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        self.events.append((port, "start"))
        await asyncio.sleep(0.002 * port)
        self.events.append((port, "end"))
        body = json.loads(request.content)
        n = len(body["prompt"])
        usage = {"prompt_tokens": n, "completion_tokens": 1}
        usage["prompt_tokens_details"] = {"cached_tokens": n // 2 if port == 1 else 0}
        if port == 1 and self.drafts_on_1:
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": 3,
                "rejected_prediction_tokens": 1,
            }
        chunks = [
            {"choices": [{"index": 0, "text": " ok", "finish_reason": "stop"}]},
            {"choices": [], "usage": usage},
        ]
        data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=data.encode())


def plan() -> BenchPlan:
    w = make_workload("unique", {"requests": "3", "prompt_tokens": "20"})
    return BenchPlan(w, LoadConfig(concurrency=2), counter=TokenCounter(None))


def run_compare(servers: TwoServers, rounds: int):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(servers)) as c:
            return await compare(c, plan(), URLS, ("on", "off"), rounds, progress=False)

    return asyncio.run(go())


def test_compare_alternates_sides_and_never_overlaps_them():
    servers = TwoServers()
    res = run_compare(servers, rounds=2)
    ports = [p for p, _ in servers.events]
    # blocks of one port at a time: A, B, then B, A for the second round
    blocks = [p for i, p in enumerate(ports) if i == 0 or ports[i - 1] != p]
    assert blocks == [1, 2, 1]
    assert [len(r) for r in res.records] == [6, 6]
    assert res.summaries[0].cache_hit_ratio > 0 and res.summaries[1].cache_hit_ratio == 0
    assert len(res.trace) == 6  # side A's requests, for the analyzer


def test_suite_report_shows_both_sides_with_ratios(tmp_path):
    res = run_compare(TwoServers(), rounds=1)
    extras = {"unique": write_run_files(tmp_path, "unique", res, None)}
    md = suite_markdown({"unique": res}, extras, "radixserve bench --suite")
    assert "| unique |" in md and "radixserve bench --suite" in md
    assert "x |" in md  # ratios
    for f in ("unique.json", "unique.trace.jsonl", "unique_ttft_cdf.png"):
        assert (tmp_path / f).exists()


def test_compare_reports_the_drafts_of_the_speculating_side(tmp_path):
    res = run_compare(TwoServers(drafts_on_1=True), rounds=1)
    on, off = res.summaries
    assert (on.draft_tokens, on.accepted_tokens, on.requests_with_drafts) == (12, 9, 3)
    assert off.requests_with_drafts == 0
    acceptance = next(x for x in res.table().splitlines() if x.startswith("acceptance rate"))
    assert "75.0%" in acceptance
    assert "decode tok/s p50" in res.table()
    write_run_files(tmp_path, "unique", res, None)
    data = json.loads((tmp_path / "unique.json").read_text())
    assert data["on"]["summary"]["acceptance_rate"] == 0.75
    assert [r["draft_tokens"] for r in data["on"]["records"]] == [4, 4, 4]
    assert {r["draft_tokens"] for r in data["off"]["records"]} == {None}


SPEC = {"method": "radix", "num_speculative_tokens": 5}
ESCAPED = json.dumps(SPEC).replace('"', '\\"')


@pytest.mark.parametrize(
    "side_b",
    [  # as typed in a shell: the JSON single-quoted inside a double-quoted command, or the reverse
        f"\"radixserve serve --port {{port}} --speculative-config '{ESCAPED}'\"",
        f"'radixserve serve --port {{port}} --speculative-config \"{ESCAPED}\"'",
    ],
)
def test_a_compare_side_command_keeps_a_quoted_json_argument_whole(side_b, tmp_path):
    command_line = 'radixserve bench --workload rag-extract --compare "radixserve serve" ' + side_b
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(shlex.split(command_line)[2:])  # what the shell hands over
    assert args.workload == "rag_extract"
    off, on = (ServerProcess(side, tmp_path) for side in args.compare)
    assert off.argv == ["radixserve", "serve", "--port", str(off.port)]
    assert on.argv[:5] == ["radixserve", "serve", "--port", str(on.port), "--speculative-config"]
    assert json.loads(on.argv[5]) == SPEC and len(on.argv) == 6
