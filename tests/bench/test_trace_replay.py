"""`bench --trace`: prompts synthesised from a block-hash trace, scaled, and sent open-loop."""

from __future__ import annotations

import asyncio
import json
from array import array

import httpx
import pytest

from radixserve.bench.hash_trace import HashRequest
from radixserve.bench.trace_replay import (
    Scaling,
    TokenBlocks,
    build_requests,
    replay_trace,
    trace_reusable_share,
)

POOL = list(range(1000, 6000))  # stands for tokenized text


def req(line: int, ts: float, length: int, ids: list[int], out: int = 8) -> HashRequest:
    return HashRequest(line, ts, length, out, array("I", ids))


def test_the_same_hash_id_gives_the_same_tokens_and_others_differ() -> None:
    blocks = TokenBlocks(POOL, seed=0)
    assert blocks.block(7, 16) == blocks.block(7, 16) == TokenBlocks(POOL, 0).block(7, 16)
    assert blocks.block(7, 16) != blocks.block(8, 16)
    assert blocks.block(7, 16) != TokenBlocks(POOL, seed=1).block(7, 16)
    assert blocks.block(7, 16) == POOL[POOL.index(blocks.block(7, 16)[0]) :][:16]  # real text


def test_prompts_share_exactly_the_blocks_their_hash_ids_share() -> None:
    trace = [req(1, 0.0, 40, [1, 2, 3]), req(2, 1.0, 36, [1, 2, 9])]  # 16-token blocks
    a, b = build_requests(trace, TokenBlocks(POOL), 16, Scaling())
    assert len(a.prompt) == 40 and len(b.prompt) == 36
    assert a.prompt[:32] == b.prompt[:32] and a.prompt[32] != b.prompt[32]
    assert a.max_tokens == 8


def test_scaling_shrinks_blocks_outputs_and_times_and_keeps_the_sharing() -> None:
    trace = [req(1, 10.0, 1500, [1, 2, 3], out=100), req(2, 30.0, 1100, [1, 2, 4], out=1)]
    scaled = Scaling(time_scale=0.1, length_scale=1 / 32, max_requests=2)
    a, b = build_requests(trace, TokenBlocks(POOL), 512, scaled)
    assert (a.at, b.at) == (0.0, 2.0)
    assert len(a.prompt) == 16 + 16 + 15  # the last block: 476 tokens / 32
    assert a.prompt[:32] == b.prompt[:32]
    assert (a.max_tokens, b.max_tokens) == (3, 1)  # at least one token
    assert len(build_requests(trace, TokenBlocks(POOL), 512, Scaling(max_requests=1))) == 1


def test_a_prompt_longer_than_the_server_context_keeps_its_head() -> None:
    (r,) = build_requests([req(1, 0.0, 64, [1, 2, 3, 4], out=50)], TokenBlocks(POOL), 16,
                          Scaling(), max_model_len=40)  # fmt: skip
    full = build_requests([req(1, 0.0, 64, [1, 2, 3, 4], out=50)], TokenBlocks(POOL), 16,
                          Scaling())[0]  # fmt: skip
    assert r.truncated and len(r.prompt) + r.max_tokens <= 40
    assert r.prompt == full.prompt[: len(r.prompt)]


def test_the_traces_reusable_share_follows_the_scaled_blocks() -> None:
    trace = [req(1, 0.0, 48, [1, 2, 3]), req(2, 1.0, 48, [1, 2, 4])]
    assert trace_reusable_share(trace, 16, Scaling()) == 32 / 96
    assert trace_reusable_share(trace, 16, Scaling(length_scale=0.5)) == 16 / 48


def test_requests_go_out_at_their_times_without_waiting_for_answers() -> None:
    """Three requests due at once: the server answers none until all three have arrived."""
    trace = [req(i, 0.0, 32, [i, 100 + i]) for i in range(3)]
    requests = build_requests(trace, TokenBlocks(POOL), 16, Scaling())
    arrived: list[dict[str, object]] = []
    all_in = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        arrived.append(body)
        if len(arrived) == 3:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), 10)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}
        chunks = [
            {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]},
            {"choices": [], "usage": usage, "timings": {"cache_n": 16}},
        ]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def run() -> list[object]:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport) as client:
            res = await replay_trace(client, "http://127.0.0.1:9", "m", requests, progress=False)
        return list(res.records)

    records = asyncio.run(run())
    assert len(records) == 3 and all(r.ok for r in records)  # type: ignore[attr-defined]
    assert all(b["ignore_eos"] is True and isinstance(b["prompt"], list) for b in arrived)
    assert [r.cached_tokens for r in records] == [16, 16, 16]  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_replay_against_a_real_server_hits_the_prefixes_the_trace_shares(counter) -> None:
    """Two requests 10 s apart share their first two 16-token blocks: the server reports the
    second's shared blocks as cached, as the trace's own reusable share predicts."""
    from radixserve.bench.client import make_client
    from radixserve.bench.servers import ServerProcess, radixserve_command
    from radixserve.bench.trace_replay import TracePlan

    trace = [req(1, 0.0, 48, [1, 2, 3], out=2), req(2, 10.0, 48, [1, 2, 4], out=2)]
    plan = TracePlan(trace, 16, Scaling(), counter.codec)
    assert plan.reusable_share == 32 / 96
    small = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "32MiB"]

    async def run(url: str):
        async with make_client() as client:
            return await plan.run(client, url, progress=False)

    with ServerProcess(radixserve_command(*small, "--log-level", "warning")) as server:
        res = asyncio.run(run(server.url))
    first, second = sorted(res.records, key=lambda r: r.id)
    assert first.ok and second.ok and first.prompt_tokens == second.prompt_tokens == 48
    assert first.cached_tokens == 0 and second.cached_tokens == 32
    assert first.completion_tokens == second.completion_tokens == 2
