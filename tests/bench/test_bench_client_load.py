"""The streaming client and the load driver against an in-process fake OpenAI server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from radixserve.bench.client import NotLoopbackError, check_loopback, send_request
from radixserve.bench.load import LoadConfig, run_load
from radixserve.bench.report import summarize
from radixserve.bench.workloads import RequestSpec, Session

URL = "http://127.0.0.1:9"


class FakeServer:
    """Streams `words` chunks per request (one per token), then a usage chunk; answers carry
    the number of messages so a test can see which turn they belong to."""

    def __init__(self, words: int = 4, delay: float = 0.01, status: int = 200) -> None:
        self.words, self.delay, self.status = words, delay, status
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "boom"}})
        chat = "messages" in body
        turn = len(body["messages"]) if chat else 1
        words = [f" w{i}-turn{turn}" for i in range(self.words)]
        prompt = sum(len(m["content"]) for m in body["messages"]) if chat else len(body["prompt"])

        async def stream():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if chat:  # a role-only first chunk, as OpenAI sends
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i, w in enumerate(words):
                await asyncio.sleep(self.delay)
                fin = "length" if i == len(words) - 1 else None
                choice = {"index": 0, "finish_reason": fin}
                choice |= {"delta": {"content": w}} if chat else {"text": w}
                yield _sse({"choices": [choice]})
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": len(words),
                "total_tokens": prompt + len(words),
                "prompt_tokens_details": {"cached_tokens": prompt // 2},
            }
            self.in_flight -= 1  # before the last chunks: the client stops reading at [DONE]
            yield _sse({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def client_for(server: FakeServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(server))


def run(coro):
    return asyncio.run(coro)


def test_client_times_a_streamed_chat_request_and_reads_usage():
    server = FakeServer(words=5, delay=0.02)
    spec = RequestSpec("r", "s", 0, "chat", 5, messages=[{"role": "user", "content": "hello"}])

    async def go():
        async with client_for(server) as c:
            return await send_request(c, URL, spec, spec.body("m"), 0.0)

    rec = run(go())
    assert rec.ok and rec.chunks == 5 and len(rec.itl) == 4
    assert rec.text == "".join(f" w{i}-turn1" for i in range(5))
    assert rec.prompt_tokens == 5 and rec.cached_tokens == 2 and rec.completion_tokens == 5
    assert 0.015 < rec.ttft < rec.e2e
    assert rec.finish_reason == "length"
    assert server.bodies[0]["stream_options"] == {"include_usage": True}


def test_client_reads_completion_chunks():
    server = FakeServer(words=3, delay=0)
    spec = RequestSpec("r", "s", 0, "completion", 3, prompt="abcdef")

    async def go():
        async with client_for(server) as c:
            return await send_request(c, URL, spec, spec.body("m"), 0.0)

    rec = run(go())
    assert rec.ok and rec.completion_tokens == 3 and rec.prompt_tokens == 6


def test_client_records_http_errors():
    spec = RequestSpec("r", "s", 0, "completion", 3, prompt="x")

    async def go():
        async with client_for(FakeServer(status=503)) as c:
            return await send_request(c, URL, spec, spec.body("m"), 0.0)

    rec = run(go())
    assert not rec.ok and "503" in rec.error


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://localhost:1/", "http://[::1]:80", "http://127.9.9.9"]
)
def test_loopback_urls_are_accepted(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:8000", "https://api.openai.com", "http://0.0.0.0:8000", "ftp://x"]
)
def test_non_loopback_urls_are_refused(url):
    with pytest.raises(NotLoopbackError):
        check_loopback(url)


def sessions(n: int, turns: int) -> list[Session]:
    return [Session(f"s{i}", [f"q{i}.{t}" for t in range(turns)], 4, "sys") for i in range(n)]


def test_next_turn_is_sent_after_and_carries_the_previous_answer():
    server = FakeServer(words=2, delay=0.005)
    ss = sessions(3, 3)

    async def go():
        async with client_for(server) as c:
            return await run_load(
                c, URL, ss, "chat", "m", LoadConfig(concurrency=3), progress=False
            )

    res = run(go())
    assert len(res.records) == 9 and all(r.ok for r in res.records)
    for body in server.bodies:
        msgs = body["messages"]
        turn = (len(msgs) - 2) // 2
        for k in range(turn):  # every earlier answer is in the history, verbatim
            assert msgs[2 + 2 * k]["content"] == f" w0-turn{2 + 2 * k} w1-turn{2 + 2 * k}"
    # turn k+1 of a session starts only after turn k finished
    by = {(r.session_id, r.turn): r for r in res.records}
    for (sid, t), r in by.items():
        if t:
            prev = by[(sid, t - 1)]
            assert r.start >= prev.start + prev.e2e - 1e-6
    assert all(s.done for s in ss)
    assert [e["turn"] for e in res.trace if e["session_id"] == "s0"] == [0, 1, 2]
    assert "stream" not in res.trace[0] and res.trace[0]["messages"][0]["role"] == "system"


def test_concurrency_bounds_requests_in_flight():
    server = FakeServer(words=2, delay=0.01)

    async def go():
        async with client_for(server) as c:
            cfg = LoadConfig(concurrency=2)
            return await run_load(c, URL, sessions(6, 1), "chat", "m", cfg, progress=False)

    res = run(go())
    assert len(res.records) == 6 and server.max_in_flight == 2


def test_max_requests_and_duration_bound_a_run():
    delay = 0.05  # each request lasts at least this long, however fast the machine
    server = FakeServer(words=1, delay=delay)

    async def go(cfg):
        async with client_for(server) as c:
            return await run_load(c, URL, sessions(200, 1), "chat", "m", cfg, progress=False)

    five = run(go(LoadConfig(concurrency=2, max_requests=5))).records
    assert len(five) == 5
    # A duration that fits about three of the slowest requests measured just now, so that a
    # busy machine makes the requests slower but does not change how many fit.
    duration = max(0.2, 3 * max(r.e2e for r in five))
    res = run(go(LoadConfig(concurrency=1, duration=duration)))
    assert 2 <= len(res.records) <= duration / delay + 1, (len(res.records), duration)


def test_poisson_arrivals_overlap_and_finish_every_request():
    server = FakeServer(words=3, delay=0.02)

    async def go():
        async with client_for(server) as c:
            cfg = LoadConfig(rate=200.0, seed=1)
            return await run_load(c, URL, sessions(12, 1), "completion", "m", cfg, progress=False)

    res = run(go())
    assert len(res.records) == 12 and server.max_in_flight > 1
    s = summarize(res.records, res.duration)
    assert s.errors == 0 and s.completion_tokens == 36 and 0 < s.cache_hit_ratio < 1


def test_a_request_whose_first_token_is_eos_still_has_a_ttft():
    rec = stream_chunks(
        [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
        ]
    )
    assert rec.ok and rec.ttft is not None and rec.chunks == 0 and rec.text == ""
    assert rec.completion_tokens == 1 and rec.finish_reason == "stop" and rec.cached_tokens == 0


def stream_usage(usage: dict):
    """Send one chat request to a server whose stream ends with `usage`; the record."""
    return stream_chunks(
        [
            {"choices": [{"index": 0, "delta": {"content": "a b c"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": usage},
        ]
    )


def stream_chunks(chunks: list[dict]):
    """Send one chat request to a server that streams `chunks` (then [DONE]); the record."""
    data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=data.encode()))
    spec = RequestSpec("r", "s", 0, "chat", 5, messages=[{"role": "user", "content": "hi"}])

    async def go():
        async with httpx.AsyncClient(transport=transport) as c:
            return await send_request(c, URL, spec, spec.body("m"), 0.0)

    return run(go())


def test_client_reads_drafted_and_accepted_tokens_from_the_usage_chunk():
    details = {"accepted_prediction_tokens": 7, "rejected_prediction_tokens": 5}
    rec = stream_usage(
        {"prompt_tokens": 3, "completion_tokens": 9, "completion_tokens_details": details}
    )
    assert rec.ok and rec.draft_tokens == 12 and rec.accepted_tokens == 7
    assert rec.acceptance_rate == pytest.approx(7 / 12)


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 3, "completion_tokens": 9},
        {"prompt_tokens": 3, "completion_tokens": 9, "completion_tokens_details": None},
        {
            "prompt_tokens": 3,
            "completion_tokens": 9,
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    ],
)
def test_client_leaves_drafts_unset_when_the_usage_reports_none(usage):
    rec = stream_usage(usage)
    assert rec.ok and rec.draft_tokens is None and rec.accepted_tokens is None
