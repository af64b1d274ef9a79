"""A cache's running counters: one mutable record, frozen into a `CacheStats` on demand."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache.pool import BlockPool
from radixserve.cache.types import CacheStats


@dataclass(slots=True)
class CacheCounters:
    """The sizes and monotonic counts a cache keeps up to date as it works.

    Each field means what the `CacheStats` field of the same name means. The cache mutates
    them under its lock only; `freeze` is how anyone else reads them.
    """

    cached_blocks: int = 0  # pool blocks held by the tree
    locked_blocks: int = 0  # of those, the ones on a locked path
    num_nodes: int = 0
    lookups: int = 0
    hit_tokens: int = 0
    missed_tokens: int = 0
    inserts: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    refetch_blocks: int = 0
    offloaded_blocks: int = 0  # tier blocks held by the tree (tiered cache only)
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    offload_hit_tokens: int = 0

    def freeze(self, pool: BlockPool, tier: BlockPool | None = None) -> CacheStats:
        """These counts plus the sizes of `pool` (and of the offload `tier`), as a frozen
        `CacheStats`. Call it under the cache's lock, so the numbers agree."""
        return CacheStats(
            cached_blocks=self.cached_blocks,
            evictable_blocks=self.cached_blocks - self.locked_blocks,
            locked_blocks=self.locked_blocks,
            num_nodes=self.num_nodes,
            lookups=self.lookups,
            hit_tokens=self.hit_tokens,
            missed_tokens=self.missed_tokens,
            inserts=self.inserts,
            inserted_blocks=self.inserted_blocks,
            evicted_blocks=self.evicted_blocks,
            free_blocks=pool.num_free,
            total_blocks=pool.num_total,
            refetch_blocks=self.refetch_blocks,
            offloaded_blocks=self.offloaded_blocks,
            offload_total_blocks=tier.num_total if tier is not None else 0,
            demoted_blocks=self.demoted_blocks,
            promoted_blocks=self.promoted_blocks,
            offload_hit_tokens=self.offload_hit_tokens,
        )
