"""The prefix cache's events (`radixserve.cache.CacheEvent`) as vLLM KV events.

A cached run of whole blocks is a `BlockStored` of their hashes (`hashing.py`) in its
medium; a dropped run a `BlockRemoved`; a move between the pool and the offload tier a
`BlockStored` in the new medium and then a `BlockRemoved` in the old one (so a consumer
never sees the blocks absent); a reset `AllBlocksCleared`. The pool's medium is "GPU" on
CUDA and "CPU" otherwise; the offload tier's is "STORAGE" for a file (--kv-offload-dir),
"CPU" in host memory under a GPU pool, and "CPU_OFFLOAD" in host memory under a CPU pool
(a distinct name, so the two tiers are never confused).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from radixserve.cache import CacheEvent, NodeRecord
from radixserve.server.kv_events.hashing import block_hash, path_hashes
from radixserve.server.kv_events.wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


def media(device: str, offload_file: bool) -> tuple[str, str]:
    """(the pool's medium, the offload tier's medium) for an engine on `device`."""
    pool = "GPU" if device.startswith("cuda") else "CPU"
    if offload_file:
        return pool, "STORAGE"
    return pool, "CPU" if pool == "GPU" else "CPU_OFFLOAD"


def salt_of_namespace(namespace: Hashable) -> str | None:
    """The cache salt a namespace stands for (the server's namespaces are salts)."""
    return namespace if namespace is None or isinstance(namespace, str) else str(namespace)


class EventTranslator:
    """Turns cache events into wire events for one engine's block size and media."""

    def __init__(self, block_size: int, pool_medium: str, tier_medium: str) -> None:
        self.block_size = block_size
        self.pool_medium = pool_medium
        self.tier_medium = tier_medium

    def translate(self, event: CacheEvent) -> list[KVEvent]:
        """The wire events of one cache event (a detailed listener's: see CacheEvent)."""
        if event.kind == "clear":
            return [AllBlocksCleared()]
        bs = self.block_size
        tokens = event.token_ids
        end = len(tokens) // bs
        first = end - event.num_tokens // bs
        if first >= end:
            return []
        salt = salt_of_namespace(event.namespace)
        hashes = path_hashes(tokens, bs, salt, end)
        run = hashes[first:]
        here = self.tier_medium if event.offloaded else self.pool_medium
        if event.kind == "insert":
            return [self._stored(hashes, first, tokens, salt, here)]
        if event.kind == "evict":
            return [BlockRemoved(list[BlockHash](run), here, group_idx=0)]
        new, old = (
            (self.tier_medium, self.pool_medium)
            if event.kind == "demote"
            else (self.pool_medium, self.tier_medium)
        )
        removed = BlockRemoved(list[BlockHash](run), old, group_idx=0)
        return [self._stored(hashes, first, tokens, salt, new), removed]

    def _stored(
        self, hashes: list[int], first: int, tokens: Sequence[int], salt: str | None, medium: str
    ) -> BlockStored:
        bs = self.block_size
        extra: list[tuple[Any, ...] | None] | None = None
        if salt is not None:
            # vLLM's shape: the salt is an extra key of the path's first block only.
            extra = [(salt,) if first + i == 0 else None for i in range(len(hashes) - first)]
        return BlockStored(
            block_hashes=list[BlockHash](hashes[first:]),
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=list(tokens[first * bs : len(hashes) * bs]),
            block_size=bs,
            lora_id=None,
            medium=medium,
            lora_name=None,
            extra_keys=extra,
            group_idx=0,
        )

    def snapshot(self, records: Sequence[NodeRecord]) -> list[KVEvent]:
        """`AllBlocksCleared`, then a `BlockStored` per node of an exported tree (parents
        first, as `PrefixCache.export_nodes` gives them): the whole cache as events."""
        out: list[KVEvent] = [AllBlocksCleared()]
        last_hash: list[int | None] = []  # per record: the hash of its last block
        for rec in records:
            parent = last_hash[rec.parent] if rec.parent >= 0 else None
            if rec.parent >= 0 and parent is None:
                last_hash.append(None)
                continue
            salt = salt_of_namespace(rec.namespace)
            bs = self.block_size
            hashes: list[int] = []
            h = parent
            for i in range(len(rec.token_ids) // bs):
                h = block_hash(h, rec.token_ids[i * bs : (i + 1) * bs], salt)
                hashes.append(h)
            last_hash.append(hashes[-1] if hashes else parent)
            extra: list[tuple[Any, ...] | None] | None = None
            if salt is not None:
                extra = [(salt,) if parent is None and i == 0 else None for i in range(len(hashes))]
            medium = self.tier_medium if rec.offloaded else self.pool_medium
            out.append(
                BlockStored(
                    block_hashes=list[BlockHash](hashes),
                    parent_block_hash=parent,
                    token_ids=list(rec.token_ids[: len(hashes) * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    extra_keys=extra,
                    group_idx=0,
                )
            )
        return out
