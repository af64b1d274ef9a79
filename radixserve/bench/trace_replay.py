"""`radixserve bench --trace FILE`: replay a block-hash trace (Mooncake, Bailian) against any
OpenAI-compatible server, as AIPerf's mooncake_trace mode does, scaled to fit a small machine.

Each hash id becomes a block of real token ids: a window of the tokenized stdlib docstrings
(`bench/corpus.py`) chosen by a hash of (seed, id), so the same id always gives the same
tokens within a run and shared prefixes of the trace are shared token for token at the
server, while different ids practically never share a token window. A request's prompt is
its blocks in order, the last one cut to the rest of `input_length`; it is sent as token ids
to /v1/completions (radixserve, vLLM and llama.cpp's server accept them) with
`max_tokens` = `output_length` and `ignore_eos`, so outputs are as long as the trace says.
Requests go out open-loop at their timestamps (times `--time-scale`), whatever the server's
pace. `--length-scale` multiplies every block's tokens and every output length (at least 1
token each), keeping the sharing structure; a prompt that still does not fit the server's
context keeps its head. Round r of a comparison draws other windows (seed + r), so no cache
has seen a round's prompts before.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from radixserve.bench.client import fetch_model, send_request
from radixserve.bench.corpus import Corpus, TextCodec, TokenCounter
from radixserve.bench.hash_trace import HashRequest, replay_hash_trace
from radixserve.bench.load import RunResult
from radixserve.bench.workloads import RequestSpec

POOL_TOKENS = 1 << 16  # tokens of real text the blocks are cut from


class TokenBlocks:
    """Token ids for hash ids: `block(h)` is the same for the same (seed, h)."""

    def __init__(self, pool: Sequence[int], seed: int = 0) -> None:
        if len(pool) < 2:
            raise ValueError("the token pool is empty")
        self.pool = list(pool)
        self.seed = seed

    @classmethod
    def from_corpus(cls, codec: TextCodec, seed: int = 0, size: int = POOL_TOKENS) -> TokenBlocks:
        """A pool of `size` tokens of stdlib docstrings, tokenized with `codec`."""
        corpus = Corpus(f"trace:{seed}", TokenCounter(codec))
        ids: list[int] = []
        while len(ids) < size:
            ids += codec.encode(corpus.passage(2048) + "\n\n")
        return cls(ids[:size], seed)

    def block(self, hash_id: int, num_tokens: int) -> list[int]:
        """`num_tokens` consecutive pool tokens at an offset drawn from (seed, hash_id)."""
        span = max(1, len(self.pool) - num_tokens)
        digest = hashlib.blake2b(f"{self.seed}:{hash_id}".encode(), digest_size=8).digest()
        start = int.from_bytes(digest, "big") % span
        out = self.pool[start : start + num_tokens]
        while len(out) < num_tokens:  # a block longer than the pool wraps around
            out += self.pool[: num_tokens - len(out)]
        return out


@dataclass(frozen=True)
class TraceRequest:
    """One request of the replay: when it goes out, its prompt ids and output length."""

    id: str
    at: float  # seconds after the start of the replay
    prompt: list[int]
    max_tokens: int
    session: str
    truncated: bool = False


@dataclass(frozen=True)
class Scaling:
    """How a trace is fitted to a machine."""

    time_scale: float = 1.0
    length_scale: float = 1.0
    max_requests: int | None = None

    def block_tokens(self, block_size: int) -> int:
        """Tokens of one full block after scaling (at least 1)."""
        return max(1, round(block_size * self.length_scale))


def build_requests(
    reqs: Sequence[HashRequest],
    blocks: TokenBlocks,
    block_size: int,
    scaling: Scaling,
    max_model_len: int | None = None,
) -> list[TraceRequest]:
    """The replay's requests: the first `max_requests` of the trace, prompts synthesised."""
    chosen = list(reqs[: scaling.max_requests] if scaling.max_requests else reqs)
    if not chosen:
        return []
    t0 = chosen[0].timestamp
    full = scaling.block_tokens(block_size)
    out = []
    for i, r in enumerate(chosen):
        n = len(r.hash_ids)
        last = max(1, round((r.input_length - (n - 1) * block_size) * scaling.length_scale))
        prompt: list[int] = []
        for k, h in enumerate(r.hash_ids):
            prompt += blocks.block(h, full if k < n - 1 else min(full, last))
        max_tokens = max(1, round(r.output_length * scaling.length_scale))
        truncated = False
        if max_model_len is not None and len(prompt) + max_tokens > max_model_len:
            max_tokens = min(max_tokens, max(1, max_model_len // 4))
            prompt = prompt[: max_model_len - max_tokens]
            truncated = True
        session = r.chat_id or f"line{r.line}"
        out.append(
            TraceRequest(
                f"t{i}", (r.timestamp - t0) * scaling.time_scale, prompt, max_tokens, session,
                truncated,
            )
        )  # fmt: skip
    return out


def trace_reusable_share(reqs: Sequence[HashRequest], block_size: int, scaling: Scaling) -> float:
    """The share of the replayed prompt tokens that repeat an earlier prompt's prefix (an
    unbounded cache, the trace's blocks scaled as the replay scales them)."""
    chosen = list(reqs[: scaling.max_requests] if scaling.max_requests else reqs)
    full = scaling.block_tokens(block_size)
    scaled = [
        HashRequest(
            r.line, r.timestamp,
            (len(r.hash_ids) - 1) * full
            + max(1, round((r.input_length - (len(r.hash_ids) - 1) * block_size)
                           * scaling.length_scale)),
            r.output_length, r.hash_ids,
        )
        for r in chosen
    ]  # fmt: skip
    if not scaled:
        return 0.0
    point, _ = replay_hash_trace(scaled, sum(len(r.hash_ids) for r in scaled), full)
    return point.hit_ratio


async def server_context(client: httpx.AsyncClient, base_url: str) -> int | None:
    """The server's max_model_len from /v1/models (radixserve, vLLM), else llama.cpp's
    /props n_ctx; None if it says neither."""
    try:
        r = await client.get(f"{base_url}/v1/models")
        for card in r.json().get("data") or []:
            n = card.get("max_model_len")
            if isinstance(n, int) and n > 0:
                return n
        r = await client.get(f"{base_url}/props")
        if r.status_code == 200:
            n = (r.json().get("default_generation_settings") or {}).get("n_ctx")
            return n if isinstance(n, int) and n > 0 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return None


async def replay_trace(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    requests: Sequence[TraceRequest],
    temperature: float = 0.0,
    progress: bool = True,
    desc: str = "trace",
) -> RunResult:
    """Send every request at its time (open loop) and wait for all; records as other
    workloads have them."""
    records = []
    trace: list[dict[str, Any]] = []
    bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()

    async def one(req: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, t0 + req.at - time.perf_counter()))
        spec = RequestSpec(req.id, req.session, 0, "completion", req.max_tokens)
        body = {
            "model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        trace.append({"id": req.id, "timestamp": round(req.at, 6), "prompt": req.prompt,
                      "max_tokens": req.max_tokens})  # fmt: skip
        records.append(await send_request(client, base_url, spec, body, t0))
        bar.update(1)

    try:
        await asyncio.gather(*(one(r) for r in requests))
    finally:
        bar.close()
    duration = max((r.start + r.e2e for r in records), default=0.0)
    trace.sort(key=lambda e: e["timestamp"])
    return RunResult(records, duration, trace)


@dataclass
class TraceWorkload:
    """What a comparison table says about a trace replay."""

    name: str
    sizes: dict[str, Any] = field(default_factory=dict)

    def params(self) -> dict[str, Any]:
        """The replay's scaling and size, for reports."""
        return dict(self.sizes)


@dataclass
class TraceLoad:
    """How a trace replay drives the server: open loop at the trace's (scaled) times."""

    time_scale: float = 1.0
    max_requests: int = 0

    def describe(self) -> str:
        """'trace arrivals x0.1, 200 requests'."""
        return f"trace arrivals x{self.time_scale:g}, {self.max_requests} requests"


@dataclass
class TracePlan:
    """A block-hash trace and how to replay it; `run` has `BenchPlan.run`'s signature, so
    `--compare` drives it like any workload."""

    reqs: Sequence[HashRequest]
    block_size: int
    scaling: Scaling
    codec: TextCodec
    seed: int = 0
    model: str | None = None
    temperature: float = 0.0
    workload: TraceWorkload = field(default_factory=lambda: TraceWorkload("trace"))
    load: TraceLoad = field(default_factory=TraceLoad)
    truncated: int = 0

    def __post_init__(self) -> None:
        n = min(len(self.reqs), self.scaling.max_requests or len(self.reqs))
        self.workload.sizes = {
            "requests": n,
            "time_scale": self.scaling.time_scale,
            "length_scale": self.scaling.length_scale,
            "block_tokens": self.scaling.block_tokens(self.block_size),
        }
        self.load = TraceLoad(self.scaling.time_scale, n)
        self.reusable_share = trace_reusable_share(self.reqs, self.block_size, self.scaling)

    async def run(
        self,
        client: httpx.AsyncClient,
        base_url: str,
        seed_offset: int = 0,
        progress: bool = True,
        desc: str = "",
    ) -> RunResult:
        """Synthesise the prompts for seed + seed_offset and replay them against `base_url`."""
        model = self.model or await fetch_model(client, base_url)
        context = await server_context(client, base_url)
        blocks = TokenBlocks.from_corpus(self.codec, self.seed + seed_offset)
        requests = build_requests(self.reqs, blocks, self.block_size, self.scaling, context)
        self.truncated = sum(1 for r in requests if r.truncated)
        return await replay_trace(
            client, base_url, model, requests, self.temperature, progress, desc or "trace"
        )
