"""The bench client against a real `radixserve serve` subprocess: it parses the stream, and
its token counts and TTFT agree with what the server reports (usage, /metrics)."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest

from radixserve.bench.analyze import TraceRequest, tokenize
from radixserve.bench.client import make_client
from radixserve.bench.load import BenchPlan, LoadConfig
from radixserve.bench.servers import ServerProcess
from radixserve.bench.workloads import make_workload

pytestmark = pytest.mark.slow

SERVER = [sys.executable, "-m", "radixserve", "serve", "--port", "{port}"]
SMALL = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "64MiB"]
BLOCK = 16


@pytest.fixture(scope="module")
def server(tokenizer):
    with ServerProcess([*SERVER, *SMALL, "--log-level", "warning"]) as s:
        yield s


def ttft_metric(text: str) -> tuple[float, float]:
    """(sum, count) of the server's TTFT histogram."""
    vals = {}
    for name in ("sum", "count"):
        m = re.search(rf"^radixserve_time_to_first_token_seconds_{name}\S* (\S+)$", text, re.M)
        vals[name] = float(m.group(1)) if m else 0.0
    return vals["sum"], vals["count"]


async def bench(url: str, plan: BenchPlan):
    async with make_client() as client:
        before = (await client.get(f"{url}/metrics")).text
        res = await plan.run(client, url, progress=False)
        after = (await client.get(f"{url}/metrics")).text
    return res, ttft_metric(before), ttft_metric(after)


def test_rag_run_agrees_with_server_usage_and_metrics(server, tokenizer):
    w = make_workload(
        "rag",
        {"requests": "3", "preamble_tokens": "256", "question_tokens": "16", "max_tokens": "6"},
    )
    plan = BenchPlan(w, LoadConfig(concurrency=1))
    res, (s0, c0), (s1, c1) = asyncio.run(bench(server.url, plan))
    recs = res.records
    assert [r.error for r in recs] == [None] * 3
    reqs = [TraceRequest(e["id"], None, messages=e["messages"]) for e in res.trace]
    assert [r.prompt_tokens for r in recs] == [len(t) for t in tokenize(reqs, tokenizer)]
    assert recs[0].cached_tokens == 0
    assert all(r.cached_tokens >= 256 - BLOCK for r in recs[1:])
    for r in recs:
        assert 1 <= r.chunks <= r.completion_tokens <= 6 and r.text
        assert 0 < r.ttft <= r.e2e and len(r.itl) == r.chunks - 1
    # The server measured the same requests' TTFT, a little less than the client saw (the
    # HTTP hops are the client's alone). Relative, not in seconds: on a busy machine the
    # hops and the prefills slow down together (measured idle: server 0.55 s of 0.63 s).
    assert c1 - c0 == 3
    client_sum = sum(r.ttft for r in recs)
    assert 0.5 * client_sum <= s1 - s0 <= client_sum + 0.01, (s1 - s0, client_sum)


def test_multi_turn_completions_hit_the_previous_turn_and_its_answer(server, tokenizer):
    w = make_workload(
        "multi_turn",
        {"conversations": "2", "turns": "2", "system_tokens": "96", "user_tokens": "32"},
    )
    w.max_tokens = 8
    plan = BenchPlan(w, LoadConfig(concurrency=2), api="completion", seed=3)
    res, _, _ = asyncio.run(bench(server.url, plan))
    by = {(r.session_id, r.turn): r for r in res.records}
    assert len(by) == 4 and all(r.ok for r in by.values())
    for e in res.trace:
        r = by[(e["session_id"], e["turn"])]
        assert r.prompt_tokens == len(tokenizer.encode(e["prompt"]))
    for sid in ("conv0", "conv1"):
        first, second = by[(sid, 0)], by[(sid, 1)]
        assert second.cached_tokens >= (first.prompt_tokens // BLOCK - 1) * BLOCK
