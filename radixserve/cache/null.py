"""The prefix cache turned off: it finds nothing and keeps nothing (the baseline)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from radixserve.cache.base import PrefixCache
from radixserve.cache.errors import InvariantError
from radixserve.cache.eviction import EvictionPolicy, LRUPolicy
from radixserve.cache.node import RadixNode
from radixserve.cache.pool import BlockPool
from radixserve.cache.snapshot import TreeSnapshot, take_snapshot
from radixserve.cache.tokens import TokenIds
from radixserve.cache.types import InsertResult, MatchResult, NodeRecord


class NullCache(PrefixCache):
    """A `PrefixCache` that caches nothing: every block stays with whoever allocated it.

    Lookups find nothing (and count as lookups that missed), `insert` takes no block,
    `allocate` takes straight from `pool`, and there is never anything to evict, lock or
    report. `policy` is only reported: the configured eviction policy, had the cache been on.
    """

    enabled = False

    def __init__(
        self, pool: BlockPool, block_size: int = 16, policy: EvictionPolicy | None = None
    ) -> None:
        super().__init__(pool, block_size)
        self._policy = policy or LRUPolicy()

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy the cache would use if it were on."""
        return self._policy

    @property
    def namespace_quota_blocks(self) -> int | None:
        """None: nothing is cached, so there is nothing to share out."""
        return None

    def match_prefix(
        self, token_ids: TokenIds, namespace: Hashable = None, count: bool = True
    ) -> MatchResult:
        """Nothing is cached: no tokens, no blocks, and the namespace's (empty) root."""
        with self._mutex:
            if count:
                self.counters.lookups += 1
                self.counters.missed_tokens += len(token_ids)
        return MatchResult(0, [], _root(namespace))

    def peek_prefix(self, token_ids: TokenIds, namespace: Hashable = None) -> int:
        """0: nothing is cached."""
        return 0

    def insert(
        self,
        token_ids: TokenIds,
        blocks: Sequence[int],
        namespace: Hashable = None,
        priority: int = 0,
        session: bool = False,
    ) -> InsertResult:
        """Take none of `blocks` (the caller keeps them all) and cache nothing; the result's
        node is the namespace's empty root. Raises ValueError on the arguments
        `RadixCache.insert` refuses."""
        if len(token_ids) != len(blocks) * self.block_size:
            raise ValueError(
                f"len(token_ids)={len(token_ids)} != "
                f"len(blocks)*block_size={len(blocks) * self.block_size}"
            )
        if not self.pool.all_used(blocks):
            raise ValueError("insert needs blocks allocated from this cache's pool")
        with self._mutex:
            self.counters.inserts += 1
        return InsertResult(0, _root(namespace), [])

    def lock(self, node: RadixNode) -> None:
        """No-op: this cache only hands out roots, which are never evicted."""

    def unlock(self, node: RadixNode) -> None:
        """No-op (see `lock`)."""

    def evict(self, num_blocks: int) -> int:
        """0: there is nothing to evict."""
        return 0

    def evict_path(self, token_ids: TokenIds, namespace: Hashable = None) -> int:
        """0: there is nothing to evict."""
        return 0

    def reset(self) -> int:
        """Nothing is cached: nothing to forget (0)."""
        return 0

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` free blocks of the pool; raises CacheFullError if it has fewer."""
        return self.pool.allocate(num_blocks)

    def leaf_paths(self) -> list[tuple[Hashable, tuple[int, ...]]]:
        """[]: nothing is cached."""
        return []

    def snapshot(self, head_tokens: int = 32) -> TreeSnapshot:
        """The snapshot of an empty tree (one root, no nodes)."""
        return take_snapshot({None: _root(None)}, self.block_size, head_tokens)

    def export_nodes(self) -> list[NodeRecord]:
        """[]: nothing is cached."""
        return []

    def restore_nodes(self, records: Sequence[NodeRecord]) -> list[RadixNode | None]:
        """None for every record: this cache keeps nothing."""
        return [None] * len(records)

    def check_invariants(self, num_private_blocks: int | None = None) -> None:
        """Raise InvariantError unless nothing is cached or locked and, with
        `num_private_blocks`, free + private == total (every used block is a request's)."""
        with self._mutex:
            c = self.counters
            if c.cached_blocks or c.locked_blocks or c.num_nodes or c.evicted_blocks:
                raise InvariantError(f"a cache that is off counts cached blocks: {c}")
            pool = self.pool
            if num_private_blocks is not None and (
                pool.num_free + num_private_blocks != pool.num_total
            ):
                raise InvariantError(
                    f"free {pool.num_free} + cached 0 + private {num_private_blocks}"
                    f" != total {pool.num_total}"
                )


def _root(namespace: Hashable) -> RadixNode:
    """A fresh empty root of `namespace`: what a lookup in an empty tree returns."""
    return RadixNode(b"", [], None, namespace)
