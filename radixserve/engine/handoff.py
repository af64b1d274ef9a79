"""Prefill/decode disaggregation, the engine's side: a prefill worker's request ends after its
first token and hands over its prompt's K/V (`KVHandoff`); a decode worker puts that K/V into
its own pool and radix tree (`import_handoff`) and continues the request from that first token,
which it emits as its own first output (`FirstToken`) instead of drawing one. Only whole
blocks travel, and only those past what the decode worker already held (`start`); the
prompt's last partial block is computed again on the decode worker, with the first token's
K/V. A model whose sliding-window layers keep their K/V in a window pool (cache/window.py)
sends those layers' K/V only for the blocks the prompt's last window lies in (`WindowKV`);
the decode worker gives window slots to those blocks alone. `encode` / `decode` are the wire
format of docs/disaggregation.md."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache import CacheFullError, PrefixCache
from radixserve.cache.window import NO_SLOT, WindowSlots
from radixserve.errors import InvalidRequestError
from radixserve.model.kv_pool import KVPool
from radixserve.model.kv_tier import gather_blocks, scatter_blocks
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
class WindowKV:
    """The sliding-window layers' K/V of some of a handoff's blocks: `blocks` are their
    indices among the handoff's blocks, `k` / `v` [window layers, len(blocks), block_size,
    kv heads, head dim]."""

    blocks: list[int]
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class KVHandoff:
    """A prompt's K/V from a prefill worker: `token_ids` is the prompt's whole blocks, and
    `k` / `v` [layers, blocks, block_size, kv heads, head dim] hold tokens [start, len) of
    them (the decode worker held the first `start`): every layer's, or with a window pool
    the full-attention layers', the windowed layers' in `window`."""

    token_ids: list[int]
    start: int
    k: torch.Tensor
    v: torch.Tensor
    first: FirstToken
    window: WindowKV | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks carried."""
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of K and V carried."""
        w = self.window
        windowed = 0 if w is None else 2 * w.k.numel() * w.k.element_size()
        return 2 * self.k.numel() * self.k.element_size() + windowed


Export = tuple[list[int], torch.Tensor, torch.Tensor, WindowKV | None]


def pool_layout(pool: KVPool) -> tuple[int, int, int, int, int]:
    """What a handoff must fit in `pool` (`decode`'s `layout`): the layers in `k`, block
    size, kv heads, head dim, and the layers in the window pool (0 without one)."""
    _, _, bs, heads, dim = pool.k.shape
    return (pool.k.shape[0], bs, heads, dim, pool.k_window.shape[0] if pool.window_slots else 0)


def export_blocks(
    pool: KVPool, slots: WindowSlots | None, block_table: list[int], tokens: list[int],
    computed: int, start: int,
) -> Export:  # fmt: skip
    """The whole blocks of `tokens` computed so far (their token ids: a prefill worker's
    request computed its prompt) and copies of their K/V from token `start` (a multiple of
    the block size) on, out of a request's `block_table`; with a window pool (`slots`), the
    windowed layers' K/V of those blocks in their last window that hold their slots."""
    bs = pool.block_size
    n_full = min(len(tokens), computed) // bs
    first = min(start // bs, n_full)
    blocks = block_table[first:n_full]
    k, v = gather_blocks(pool, blocks)
    window = None
    if slots is not None and n_full:
        lo = max(first, slots.first_needed(n_full * bs - 1))
        carried = [j - first for j in range(lo, n_full) if slots.slot_of(blocks[j - first]) >= 0]
        idx = torch.tensor([slots.slot_of(blocks[j]) for j in carried], dtype=torch.long)
        window = WindowKV(
            carried, pool.k_window.index_select(1, idx), pool.v_window.index_select(1, idx)
        )
    return tokens[: n_full * bs], k, v, window


def import_handoff(
    cache: PrefixCache, pool: KVPool, handoff: KVHandoff, namespace: Any = None
) -> int:
    """Put `handoff`'s K/V into `pool` and `cache` behind the prefix the cache holds; returns
    the tokens added. Nothing is added where the cache no longer holds the first `start`
    tokens (they were evicted since the prefill was asked for: the request computes them),
    or has no blocks to spare. With a window pool, only the new blocks whose windowed K/V
    came keep the slots they were allocated with. Call on the engine's loop thread, between
    steps."""
    bs, ids = cache.block_size, handoff.token_ids
    if not cache.enabled:  # caches nothing: the request computes its prompt
        return 0
    have = cache.peek_prefix(ids, namespace)
    if have < handoff.start or have >= len(ids):
        return 0
    match = cache.match_prefix(ids[:have], namespace, count=False)
    if match.num_tokens != have:
        return 0
    if have:
        cache.lock(match.node)
    try:
        skip = (have - handoff.start) // bs
        slots = cache.pool.window
        new = _allocate(cache, (len(ids) - have) // bs)  # the match is locked: kept
        if new is None:
            return 0
        scatter_blocks(pool, new, handoff.k[:, skip:], handoff.v[:, skip:])
        slotted = _fill_window(pool, slots, new, handoff.window, skip) if slots else []
        res = cache.insert(ids, list(match.blocks) + new, namespace)
        cache.pool.free(res.duplicate_blocks)
        if slots is not None:  # allocated pinned for us; now cached like any other
            dropped = set(res.duplicate_blocks)
            slots.unpin([b for b in slotted if b not in dropped])
    finally:
        if have:
            cache.unlock(match.node)
    return len(ids) - have


def _allocate(cache: PrefixCache, n: int) -> list[int] | None:
    """`n` blocks from `cache` (evicting as it must), or None, allocating nothing, where it
    has not that many. With a window pool a block at a time, each giving back its slot: a
    handoff's blocks outnumber the pool's slots, and only those `_fill_window` fills keep
    one (it takes them again)."""
    slots = cache.pool.window
    try:
        if slots is None:
            return cache.allocate(n)
        new: list[int] = []
        for _ in range(n):
            new += cache.allocate(1)
            slots.drop(new[-1:])
        return new
    except CacheFullError:
        cache.pool.free(new if slots is not None else [])
        return None


def _fill_window(
    pool: KVPool, slots: WindowSlots, new: list[int], window: WindowKV | None, skip: int
) -> list[int]:
    """Give the `new` blocks (the handoff's blocks from `skip` on, slotless) whose windowed
    K/V `window` carries slots (pinned once), and write it there; the blocks that got one.
    Where the slots run short, the later blocks go without (the request computes them)."""
    carried = {} if window is None else {b - skip: i for i, b in enumerate(window.blocks)}
    kept: list[int] = []
    for r, b in enumerate(new):
        i = carried.get(r)
        if window is None or i is None:
            continue
        try:
            slots.take([b])
        except CacheFullError:
            break
        slot = slots.slot_of(b)
        assert slot != NO_SLOT
        pool.k_window[:, slot] = window.k[:, i]
        pool.v_window[:, slot] = window.v[:, i]
        kept.append(b)
    return kept


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
        "window_blocks": None if handoff.window is None else handoff.window.blocks,
        "window_layers": 0 if handoff.window is None else int(handoff.window.k.shape[0]),
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    tensors = [handoff.k, handoff.v]
    if handoff.window is not None:
        tensors += [handoff.window.k, handoff.window.v]
    kv = [t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in tensors]
    return [memoryview(MAGIC + _LEN.pack(len(raw)) + raw), *(a.data for a in kv)]


def encode(handoff: KVHandoff) -> bytes:
    """`handoff` in the wire format, as one bytes object (`encode_parts`, joined)."""
    return b"".join(encode_parts(handoff))


def decode(
    data: bytes | bytearray | memoryview, layout: tuple[int, int, int, int, int],
    dtype: torch.dtype,
) -> KVHandoff:  # fmt: skip
    """The handoff in `data` (as `encode` writes it); InvalidRequestError unless it is whole
    and its K/V fit this pool: `layout` is (layers in `k`, block_size, kv heads, head dim,
    layers in the window pool or 0), and `dtype` its K/V dtype. The two workers must serve
    the same model with the same block size, K/V dtype and window pool or none. K and V are
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
        wb = h.get("window_blocks")
        window_blocks = None if wb is None else [int(b) for b in wb]
        window_layers = int(h.get("window_layers", 0))
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise InvalidRequestError(f"a K/V handoff's header is malformed: {e!r}") from None
    layers, bs, heads, dim, pool_window_layers = layout
    fits = (
        kv_dtype == dtype and len(shape) == 5 and shape[:1] + shape[2:] == [layers, bs, heads, dim]
    )
    if not fits or window_layers != pool_window_layers:
        raise InvalidRequestError(
            f"a K/V handoff of {h['dtype']} {shape} (+{window_layers} window-pool layers) does "
            f"not fit this pool ({str(dtype).removeprefix('torch.')} [{layers}, *, {bs}, "
            f"{heads}, {dim}] +{pool_window_layers}): the prefill and decode workers must "
            "serve the same model, block size and K/V dtype"
        )
    blocks = shape[1]
    if start % bs or len(ids) % bs or len(ids) - start != blocks * bs:
        raise InvalidRequestError("a K/V handoff's token ids and blocks do not agree")
    if (window_blocks is None) != (window_layers == 0) or any(
        not 0 <= b < blocks for b in window_blocks or ()
    ):
        raise InvalidRequestError("a K/V handoff's window blocks do not agree with its blocks")
    row = bs * heads * dim * torch.tensor([], dtype=dtype).element_size()
    size, wsize = layers * blocks * row, window_layers * len(window_blocks or ()) * row
    if len(data) != head + n + 2 * size + 2 * wsize:
        raise InvalidRequestError("a K/V handoff is truncated")
    body = memoryview(data)[head + n :]
    if body.readonly:
        body = memoryview(bytearray(body))

    def tensor(at: int, nbytes: int, dims: list[int]) -> torch.Tensor:
        part = body[at : at + nbytes]
        if not nbytes:
            return torch.empty(dims, dtype=dtype)
        return torch.frombuffer(part, dtype=torch.uint8).view(dtype).view(dims)

    k, v = tensor(0, size, shape), tensor(size, size, shape)
    window = None
    if window_blocks is not None:
        wshape = [window_layers, len(window_blocks), bs, heads, dim]
        wk, wv = tensor(2 * size, wsize, wshape), tensor(2 * size + wsize, wsize, wshape)
        window = WindowKV(window_blocks, wk, wv)
    return KVHandoff(ids, start, k, v, FirstToken(first_id, logprobs, cached), window)
