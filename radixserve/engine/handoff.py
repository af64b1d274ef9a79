"""Prefill/decode disaggregation, the engine's side: a prefill worker's request ends after its
first token and hands over its prompt's K/V (`KVHandoff`); a decode worker puts that K/V into
its own pool and radix tree (`import_handoff`) and continues the request from that first token,
which it emits as its own first output (`FirstToken`) instead of drawing one. Only whole
blocks travel, and only those past what the decode worker already held (`start`); the
prompt's last partial block is computed again on the decode worker, with the first token's
K/V. `encode` / `decode` are the wire format of docs/disaggregation.md."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache import CacheFullError, PrefixCache
from radixserve.errors import InvalidRequestError
from radixserve.model.kv_tier import KVStore, gather_blocks, scatter_blocks
from radixserve.model.sampling import TokenLogprobs

MAGIC = b"RADIXSERVE-PD-1\n"
_LEN = struct.Struct("<Q")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FirstToken:
    """The token a prefill worker drew after the prompt, its log-probs where the request asked
    for them, and how many prompt tokens that worker's cache gave it."""

    token_id: int
    logprobs: TokenLogprobs | None = None
    cached_tokens: int = 0


@dataclass
class KVHandoff:
    """A prompt's K/V from a prefill worker: `token_ids` is the prompt's whole blocks, and
    `k` / `v` [layers, blocks, block_size, kv heads, head dim] hold tokens [start, len) of
    them (the decode worker held the first `start`)."""

    token_ids: list[int]
    start: int
    k: torch.Tensor
    v: torch.Tensor
    first: FirstToken

    @property
    def num_blocks(self) -> int:
        """Blocks carried."""
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of K and V carried."""
        return 2 * self.k.numel() * self.k.element_size()


def export_blocks(
    pool: KVStore, block_table: list[int], prompt: list[int], computed: int, block_size: int,
    start: int,
) -> tuple[list[int], torch.Tensor, torch.Tensor]:  # fmt: skip
    """The prompt's whole blocks computed so far (token ids) and copies of their K/V from
    token `start` (a multiple of `block_size`) on, out of a request's `block_table`."""
    n_full = min(len(prompt), computed) // block_size
    first = min(start // block_size, n_full)
    k, v = gather_blocks(pool, block_table[first:n_full])
    return prompt[: n_full * block_size], k, v


def import_handoff(
    cache: PrefixCache, pool: KVStore, handoff: KVHandoff, namespace: Any = None
) -> int:
    """Put `handoff`'s K/V into `pool` and `cache` behind the prefix the cache holds; returns
    the tokens added. Nothing is added where the cache no longer holds the first `start`
    tokens (they were evicted since the prefill was asked for: the request computes them),
    or has no blocks to spare. Call on the engine's loop thread, between steps."""
    bs, ids = cache.block_size, handoff.token_ids
    have = cache.peek_prefix(ids, namespace)
    if have < handoff.start or have >= len(ids):
        return 0
    match = cache.match_prefix(ids[:have], namespace, count=False)
    if match.num_tokens != have:
        return 0
    if have:
        cache.lock(match.node)
    try:
        try:
            new = cache.allocate((len(ids) - have) // bs)  # the match is locked: kept
        except CacheFullError:
            return 0
        skip = (have - handoff.start) // bs
        scatter_blocks(pool, new, handoff.k[:, skip:], handoff.v[:, skip:])
        res = cache.insert(ids, list(match.blocks) + new, namespace)
        cache.pool.free(res.duplicate_blocks)
    finally:
        if have:
            cache.unlock(match.node)
    return len(ids) - have


def encode_parts(handoff: KVHandoff) -> list[memoryview]:
    """`handoff` in the wire format, as views that copy nothing: MAGIC, the header's length
    (u64, little-endian) and the header (JSON), then K's bytes and V's, each [layers, blocks,
    block_size, kv heads, head dim] in the header's dtype, C order."""
    first = handoff.first
    lp = first.logprobs
    header = {
        "token_ids": handoff.token_ids,
        "start": handoff.start,
        "dtype": str(handoff.k.dtype).removeprefix("torch."),
        "shape": list(handoff.k.shape),
        "first_token": first.token_id,
        "first_logprobs": None if lp is None else [lp.token_id, lp.logprob, lp.top],
        "cached_tokens": first.cached_tokens,
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    kv = [t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in (handoff.k, handoff.v)]
    return [memoryview(MAGIC + _LEN.pack(len(raw)) + raw), *(a.data for a in kv)]


def encode(handoff: KVHandoff) -> bytes:
    """`handoff` in the wire format, as one bytes object (`encode_parts`, joined)."""
    return b"".join(encode_parts(handoff))


def decode(
    data: bytes | bytearray | memoryview, layout: tuple[int, int, int, int], dtype: torch.dtype
) -> KVHandoff:
    """The handoff in `data` (as `encode` writes it); InvalidRequestError unless it is whole
    and its K/V have this pool's `layout` (layers, block_size, kv heads, head dim) and
    `dtype`: the two workers must serve the same model with the same K/V dtype. K and V are
    views of `data` where it is writable (a bytearray), else copies."""
    head = len(MAGIC) + _LEN.size
    if len(data) < head or data[: len(MAGIC)] != MAGIC:
        raise InvalidRequestError("not a radixserve K/V handoff")
    (n,) = _LEN.unpack(data[len(MAGIC) : head])
    try:
        h = json.loads(bytes(data[head : head + n]))
        shape = [int(x) for x in h["shape"]]
        kv_dtype = _DTYPES[h["dtype"]]
        ids = [int(t) for t in h["token_ids"]]
        start, first_id, cached = int(h["start"]), int(h["first_token"]), int(h["cached_tokens"])
        lp = h["first_logprobs"]
        logprobs = None if lp is None else TokenLogprobs(int(lp[0]), float(lp[1]), [
            (int(t), float(p)) for t, p in lp[2]
        ])  # fmt: skip
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise InvalidRequestError(f"a K/V handoff's header is malformed: {e!r}") from None
    layers, bs, heads, dim = layout
    if kv_dtype != dtype or len(shape) != 5 or shape[:1] + shape[2:] != [layers, bs, heads, dim]:
        raise InvalidRequestError(
            f"a K/V handoff of {h['dtype']} {shape} does not fit this pool "
            f"({str(dtype).removeprefix('torch.')} [{layers}, *, {bs}, {heads}, {dim}]): "
            "the prefill and decode workers must serve the same model, block size and K/V dtype"
        )
    blocks = shape[1]
    if start % bs or len(ids) % bs or len(ids) - start != blocks * bs:
        raise InvalidRequestError("a K/V handoff's token ids and blocks do not agree")
    size = layers * blocks * bs * heads * dim * torch.tensor([], dtype=dtype).element_size()
    if len(data) != head + n + 2 * size:
        raise InvalidRequestError("a K/V handoff is truncated")
    body = memoryview(data)[head + n :]
    if body.readonly:
        body = memoryview(bytearray(body))
    k, v = (
        torch.frombuffer(part, dtype=torch.uint8).view(dtype).view(shape)
        if size
        else torch.empty(shape, dtype=dtype)
        for part in (body[:size], body[size:])
    )
    return KVHandoff(ids, start, k, v, FirstToken(first_id, logprobs, cached))
