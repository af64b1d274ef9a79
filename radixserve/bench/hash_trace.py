"""Block-hash traces (Mooncake's FAST'25 traces, Alibaba's Bailian traces): reading them, and
what a prefix cache would save on them, without tokenizing anything.

Formats, told apart by the first line:
- Mooncake: {"timestamp": ms, "input_length", "output_length", "hash_ids"}, 512-token blocks.
- Bailian: {"chat_id", "parent_chat_id", "timestamp": s, "input_length", "output_length",
  "type", "turn", "hash_ids"}, 16-token blocks.
A request's prompt is its list of hash ids: block i holds `block_size` tokens and the last
one the rest of `input_length`. Two requests share their first k blocks when their first k
ids are equal (the ids name prefixes, as vLLM's block hashes do), so the analysis replays
the ids through the same `RadixCache` the server uses, one id per "token" (block size 1),
and weighs each matched block by its tokens. Memory grows with the blocks of the trace (4
bytes per id) and the cache replayed, never with its tokens: the Mooncake conversation trace
(12,031 requests, 145 million tokens) is 288,500 ids.

Output tokens have no ids in these traces, so the blocks of an answer count as new when the
next turn sends them: the reusable share is a lower bound for a server that caches its
answers (radixserve does).
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.bench.analyze import Analysis, CachePoint, fill_curves
from radixserve.cache import DEFAULT_POLICY, BlockPool, RadixCache, make_policy
from radixserve.values import ceil_div

FORMATS = {"mooncake": 512, "bailian": 16}  # each format's block size in tokens
_MAX_ID = 2**32 - 1  # the cache packs ids as 32-bit tokens; bigger ids are renumbered


@dataclass(frozen=True)
class HashRequest:
    """One request of a block-hash trace."""

    line: int
    timestamp: float  # seconds (Mooncake's milliseconds converted)
    input_length: int
    output_length: int
    hash_ids: array[int]  # "I": 32-bit ids (renumbered if the trace's do not fit)
    chat_id: str | None = None
    parent_chat_id: str | None = None
    kind: str | None = None  # Bailian's `type`
    turn: int | None = None


class TraceLineError(ValueError):
    """A line of a trace that is not a request of its format (the message names the line)."""


def detect_format(path: str | Path) -> str:
    """ "mooncake", "bailian" or "openai" (anything else: OpenAI request bodies), from the
    first non-empty line."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError:
                    return "openai"  # its reader names the bad line
                if isinstance(obj, dict) and "hash_ids" in obj:
                    return "bailian" if "chat_id" in obj else "mooncake"
                return "openai"
    return "openai"


def _int_field(obj: dict[str, Any], key: str, lineno: int, low: int = 0) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise TraceLineError(f"line {lineno}: {key!r} must be a whole number >= {low}")
    return value


class _Ids:
    """Packs hash ids as 32-bit values, renumbering all of them once one does not fit."""

    def __init__(self) -> None:
        self.renumber: dict[int, int] | None = None

    def pack(self, ids: list[Any], lineno: int) -> array[int]:
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TraceLineError(f"line {lineno}: 'hash_ids' must be a list of integers")
        if self.renumber is None and all(0 <= i <= _MAX_ID for i in ids):
            return array("I", ids)
        if self.renumber is None:
            raise _Renumber
        table = self.renumber
        return array("I", [table.setdefault(i, len(table)) for i in ids])


class _Renumber(Exception):
    """An id does not fit 32 bits: read the trace again with renumbering on."""


def read_hash_trace(
    path: str | Path,
    fmt: str,
    block_size: int,
    strict: bool = False,
    problems: list[str] | None = None,
) -> list[HashRequest]:
    """The requests of a Mooncake or Bailian trace, in arrival order (stable by timestamp).

    A malformed line (not JSON, a field missing or of the wrong type, or as many hash ids as
    `input_length` does not fill at `block_size`) raises TraceLineError with `strict`, and is
    otherwise left out with its message appended to `problems`.
    """
    ids = _Ids()
    try:
        out = _read(path, fmt, block_size, strict, problems, ids)
    except _Renumber:
        ids.renumber = {}
        if problems is not None:
            problems.clear()
        out = _read(path, fmt, block_size, strict, problems, ids)
    out.sort(key=lambda r: r.timestamp)
    return out


def _read(
    path: str | Path,
    fmt: str,
    block_size: int,
    strict: bool,
    problems: list[str] | None,
    ids: _Ids,
) -> list[HashRequest]:
    out: list[HashRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_parse(line, lineno, fmt, block_size, ids))
            except TraceLineError as e:
                if strict or problems is None:
                    raise
                problems.append(str(e))
    return out


def _parse(line: str, lineno: int, fmt: str, block_size: int, ids: _Ids) -> HashRequest:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise TraceLineError(f"line {lineno}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise TraceLineError(f"line {lineno}: expected a JSON object")
    stamp = obj.get("timestamp")
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not math.isfinite(stamp):
        raise TraceLineError(f"line {lineno}: 'timestamp' must be a number")
    input_length = _int_field(obj, "input_length", lineno, 1)
    output_length = _int_field(obj, "output_length", lineno)
    raw = obj.get("hash_ids")
    if not isinstance(raw, list) or not raw:
        raise TraceLineError(f"line {lineno}: 'hash_ids' must be a non-empty list")
    need = ceil_div(input_length, block_size)
    if len(raw) != need:
        raise TraceLineError(
            f"line {lineno}: {len(raw)} hash ids for input_length {input_length}, which needs "
            f"{need} at --trace-block-size {block_size}"
        )
    packed = ids.pack(raw, lineno)
    if fmt == "mooncake":
        return HashRequest(lineno, stamp / 1000.0, input_length, output_length, packed)
    turn = obj.get("turn")
    parent = obj.get("parent_chat_id")
    return HashRequest(
        lineno, float(stamp), input_length, output_length, packed,
        chat_id=str(obj.get("chat_id")), parent_chat_id=None if parent in (None, -1, "-1")
        else str(parent), kind=str(obj["type"]) if obj.get("type") is not None else None,
        turn=turn if isinstance(turn, int) else None,
    )  # fmt: skip


def block_tokens(req: HashRequest, num_blocks: int, block_size: int) -> int:
    """Tokens in the first `num_blocks` blocks of `req` (the last block holds the rest)."""
    return min(num_blocks * block_size, req.input_length)


def replay_hash_trace(
    reqs: Sequence[HashRequest],
    capacity_blocks: int,
    block_size: int,
    policy: str = DEFAULT_POLICY,
    matched: list[int] | None = None,
) -> tuple[CachePoint, int]:
    """Send the trace through a `RadixCache` of `capacity_blocks` trace blocks evicting by
    `policy`; each request's blocks are inserted after it is looked up, as the server does.
    Returns the point (hit tokens weighed by the tokens of each block) and the blocks cached
    at the end; with `matched`, appends each request's hit tokens to it."""
    pool = BlockPool(num_blocks=capacity_blocks)
    cache = RadixCache(pool, block_size=1, policy=make_policy(policy), refetch_window_s=0)
    hit = total = 0
    for req in reqs:
        ids = req.hash_ids
        total += req.input_length
        m = cache.match_prefix(ids)
        got = block_tokens(req, m.num_tokens, block_size)
        hit += got
        if matched is not None:
            matched.append(got)
        need = len(ids) - m.num_tokens
        if need <= 0:
            continue
        cache.lock(m.node)
        if pool.num_free < need:
            cache.evict(need - pool.num_free)
        new = pool.allocate(min(need, pool.num_free))
        cache.unlock(m.node)
        if not new:
            continue
        blocks = list(m.blocks) + new
        res = cache.insert(ids[: len(blocks)], blocks)
        if res.duplicate_blocks:
            pool.free(res.duplicate_blocks)
    stats = cache.stats()
    point = CachePoint(capacity_blocks, 0, hit, hit / total if total else 0.0, stats.evicted_blocks)
    return point, stats.cached_blocks


def analyze_hash_trace(
    reqs: Sequence[HashRequest],
    block_size: int,
    fmt: str,
    kv_bytes: int = 0,
    kv_dtype: str = "bfloat16",
    capacities: Sequence[int] | None = None,
    policies: Sequence[str] = (),
) -> Analysis:
    """The reusable-prefill share with an unbounded cache, the miss-ratio curve over cache
    sizes (trace blocks; bytes at `kv_bytes` per token) and, with `policies`, each policy's
    curve at the same sizes."""
    unbounded = max(1, sum(len(r.hash_ids) for r in reqs))
    shared: list[int] = []
    _, working = replay_hash_trace(reqs, unbounded, block_size, matched=shared)
    reusable = sum(shared)
    a = Analysis(
        num_requests=len(reqs),
        prompt_tokens=sum(r.input_length for r in reqs),
        shared_tokens=reusable,
        shared_tokens_block=reusable,
        block_size=block_size,
        kv_bytes_per_token=kv_bytes,
        kv_dtype=kv_dtype,
        working_set_blocks=working,
        shared_lengths=shared,
        exact=False,
        trace_format=fmt,
        breakdown=breakdown(reqs, shared),
    )

    def point(cap: int, policy: str = DEFAULT_POLICY) -> CachePoint:
        p, _ = replay_hash_trace(reqs, cap, block_size, policy)
        p.capacity_bytes = cap * a.bytes_per_block
        return p

    fill_curves(a, point, capacities, policies)
    return a


def breakdown(reqs: Sequence[HashRequest], shared: Sequence[int]) -> dict[str, dict[str, int]]:
    """Requests, prompt tokens and reusable tokens by Bailian `type` and by first or later
    turn; empty for traces without them."""
    rows: dict[str, dict[str, int]] = {}

    def add(label: str, req: HashRequest, reuse: int) -> None:
        row = rows.setdefault(label, {"requests": 0, "prompt_tokens": 0, "reusable": 0})
        row["requests"] += 1
        row["prompt_tokens"] += req.input_length
        row["reusable"] += reuse

    labels: list[Callable[[HashRequest], str | None]] = [
        lambda r: None if r.kind is None else f"type {r.kind}",
        lambda r: None if r.turn is None else ("first turn" if r.turn <= 1 else "later turns"),
    ]
    for req, reuse in zip(reqs, shared, strict=True):
        for label_of in labels:
            label = label_of(req)
            if label is not None:
                add(label, req, reuse)
    return dict(sorted(rows.items()))
