"""Values that cross the cache's boundary: lookup and insert results, events, statistics."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

if TYPE_CHECKING:
    from radixserve.cache.node import RadixNode


class MatchResult(NamedTuple):
    """The longest block-aligned cached prefix of a query.

    `node` is the deepest node of the matched path (a root when nothing matched);
    pass it to the cache's `lock` to pin `blocks` while a request uses them.
    """

    num_tokens: int
    blocks: list[int]
    node: RadixNode


class BlockMover(Protocol):
    """Moves the KV bytes of blocks between the pool and the offload tier.

    The cache decides which block ids move and calls these synchronously; the model side
    (`radixserve.model.kv_tier`) implements them. `src[i]` is copied to `dst[i]`.
    """

    def demote(self, pool_blocks: list[int], tier_blocks: list[int]) -> None:
        """Copy pool blocks into tier blocks."""

    def promote(self, tier_blocks: list[int], pool_blocks: list[int]) -> None:
        """Copy tier blocks into pool blocks."""


class NodeRecord(NamedTuple):
    """One node of an exported tree: its own run of tokens under record `parent`.

    `parent` is the index of the parent's record in the same export, or -1 for the
    namespace's root; `blocks` are pool ids, or tier ids if `offloaded`.
    """

    parent: int
    namespace: Hashable
    token_ids: tuple[int, ...]
    blocks: list[int]
    offloaded: bool
    last_access: int
    priority: int


class InsertResult(NamedTuple):
    """What a cache's `insert` did with a sequence.

    `num_cached_tokens`: leading tokens that were already cached before the call.
    `node`: deepest node of the inserted path (lock it to keep the sequence pinned); the
    cache holds the blocks of the path root..node: the whole sequence in a `RadixCache`,
    none of it in a `NullCache` (whose `node` is a root).
    `duplicate_blocks`: the caller's blocks in that already-cached range that are not
    the tree's own blocks; the tree did not take them, so the caller must free them.
    """

    num_cached_tokens: int
    node: RadixNode
    duplicate_blocks: list[int]


class CacheEvent(NamedTuple):
    """A change of which token prefixes are cached, delivered to listeners.

    `token_ids` is the full path from the root of `namespace` to the end of the run
    that changed; the last `num_tokens` of them are the run that became cached
    ("insert") or stopped being cached ("evict"). Everything before them stays cached.
    `offloaded`: the run is (insert) or was (evict) in the offload tier, not the pool.

    Listeners added with `detail=True` (see `PrefixCache.add_listener`) also get "demote"
    and "promote" (the run moved from the pool to the offload tier, or back; it stays
    cached) and, for a `reset`, one "clear" (nothing is cached any more; namespace None,
    no tokens) followed by an "insert" per node that stayed (pinned by a request).
    """

    kind: Literal["insert", "evict", "demote", "promote", "clear"]
    namespace: Hashable
    token_ids: tuple[int, ...]
    num_tokens: int
    offloaded: bool = False


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's size and counters.

    `hit_tokens` + `missed_tokens` is the total length of all `match_prefix` queries:
    a query's tokens beyond its matched prefix count as missed, including a trailing
    partial block (which can never be cached). `peek_prefix` is not counted.
    With an offload tier, `cached_blocks` counts pool blocks only; `offloaded_blocks`
    the tier's; `evicted_blocks` what left the cache for good; `offload_hit_tokens` the
    part of `hit_tokens` promoted back from the tier.
    """

    cached_blocks: int
    evictable_blocks: int
    locked_blocks: int
    num_nodes: int
    lookups: int
    hit_tokens: int
    missed_tokens: int
    inserts: int
    inserted_blocks: int
    evicted_blocks: int
    free_blocks: int
    total_blocks: int
    refetch_blocks: int = 0  # cached again within the refetch window of their eviction
    offloaded_blocks: int = 0
    offload_total_blocks: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    offload_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens that were served from the cache (0.0 before any query)."""
        total = self.hit_tokens + self.missed_tokens
        return self.hit_tokens / total if total else 0.0

    def as_dict(self) -> dict[str, int | float]:
        """Every field plus `hit_rate`, as a plain dict (for JSON and metrics)."""
        out: dict[str, int | float] = dataclasses.asdict(self)
        out["hit_rate"] = self.hit_rate
        return out
