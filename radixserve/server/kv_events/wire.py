"""vLLM's KV event wire format: the message values, encoding, and a reader for every shape.

A publisher sends each batch as three ZMQ frames: the topic, the batch's sequence number (8
bytes, big-endian, from 0 per publisher process) and the msgpack of a `KVEventBatch`, an
array `[ts, events, data_parallel_rank?]`. An event is `BlockStored`, `BlockRemoved` or
`AllBlocksCleared`. vLLM has encoded events in two ways: as maps with a "type" key (0.11
and later: `{"type": "BlockStored", "block_hashes": [...], ...}`) and as arrays tagged by
their first element (`["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
medium]`). `decode_batch` reads both; `encode_batch` writes maps, as vLLM 0.32 does. Block
hashes are 64-bit ints (vLLM's default) or bytes (its sha256 digests); both are kept as
they come.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

BlockHash = int | bytes
"""vLLM's `ExternalBlockHash`."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay socket's last answer to a request."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks became cached in `medium`: `block_hashes[i]` holds `token_ids[i * block_size:
    (i + 1) * block_size]` and follows `block_hashes[i - 1]` (the first follows
    `parent_block_hash`, None at the start of a sequence). `extra_keys`, one entry per block
    or None, holds what else went into its hash (the cache salt, in the first block)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks stopped being cached in `medium` (they may still be cached in another)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Nothing is cached any more, in any medium."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type[KVEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one publish, in order; `ts` is the publisher's time.time()."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class WireError(ValueError):
    """A payload that is not a KV event batch."""


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of `batch` (events as maps, as vLLM 0.11+ sends them)."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Read a batch in either of vLLM's encodings (events as maps or as tagged arrays;
    the batch itself as an array or a map). Events of a type it does not know are left
    out. Raises WireError for anything else."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise WireError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and 2 <= len(raw) <= 3:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    else:
        raise WireError(f"a batch is [ts, events, rank?], got {type(raw).__name__}")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise WireError("a batch needs a numeric ts and a list of events")
    out = [e for e in (decode_event(item) for item in events) if e is not None]
    return KVEventBatch(float(ts), out, rank if isinstance(rank, int) else None)


def decode_event(item: Any) -> KVEvent | None:
    """One event from its map or tagged-array form; None if its type is unknown."""
    if isinstance(item, dict):
        tag, fields = item.get("type"), {k: v for k, v in item.items() if k != "type"}
    elif isinstance(item, list) and item and isinstance(item[0], str):
        tag = item[0]
        cls = EVENT_TYPES.get(tag)
        if cls is None:
            return None
        names = cls.__struct_fields__
        if len(item) - 1 > len(names):
            raise WireError(f"{tag} has {len(item) - 1} fields, at most {len(names)} known")
        fields = dict(zip(names, item[1:], strict=False))
    else:
        raise WireError(f"an event is a map or a tagged array, got {item!r:.80}")
    cls = EVENT_TYPES.get(str(tag))
    if cls is None:
        return None
    known = {k: v for k, v in fields.items() if k in cls.__struct_fields__}
    _fill_required(cls, known)
    try:
        return msgspec.convert(known, cls, strict=False)
    except msgspec.ValidationError as e:
        raise WireError(f"bad {tag}: {e}") from None


def _fill_required(cls: type[KVEvent], fields: dict[str, Any]) -> None:
    # Older publishers left out fields added later (medium, lora_name): they mean None.
    for name in ("lora_id", "medium", "lora_name", "parent_block_hash"):
        if name in cls.__struct_fields__:
            fields.setdefault(name, None)


def salt_of(extra_keys: Sequence[Any] | None, lora_name: str | None = None) -> str | None:
    """The cache salt in one block's `extra_keys` entry (None if it has none). The entry
    holds, in order, the LoRA name (when the event has `lora_name`), `(mm_id, offset)`
    pairs, the salt and prompt-embedding digests (bytes): the first plain string after
    the LoRA name."""
    if not extra_keys:
        return None
    items = list(extra_keys)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    for key in items:
        if isinstance(key, str):
            return key
    return None
