"""The radix cache with a second tier: evicting demotes to it, matching promotes back."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from radixserve.cache.errors import CacheFullError
from radixserve.cache.eviction import EvictionPolicy, EvictionQueue, dequeue, is_droppable
from radixserve.cache.node import RadixNode
from radixserve.cache.pool import BlockPool
from radixserve.cache.radix import RadixCache
from radixserve.cache.tokens import decode
from radixserve.cache.trie import post_order
from radixserve.cache.types import BlockMover, CacheEvent, CacheStats, NodeRecord


class TieredRadixCache(RadixCache):
    """A `RadixCache` whose evictions move nodes to an offload `tier` (a second block pool)
    instead of dropping them, with `mover` copying the bytes (see docs/kv-offload.md).

    A node is in the pool or `offloaded`, whole, and offloaded nodes form the bottom of the
    tree (a pool node's children may be offloaded, never the reverse). The tier drops its
    own leaves by the same policy to make room; only a drop is an eviction ("evict" event,
    `evicted_blocks`). A match through offloaded nodes promotes them back into the pool.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        policy: EvictionPolicy | None,
        tier: BlockPool,
        mover: BlockMover,
        *,
        namespace_quota: float | None = None,
        refetch_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            pool,
            block_size,
            policy,
            namespace_quota=namespace_quota,
            refetch_window_s=refetch_window_s,
            clock=clock,
        )
        self.tier = tier
        self._mover = mover
        self._tier_queue = EvictionQueue(self._policy, is_droppable)  # offloaded leaves

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` pool blocks by demoting unlocked pool leaves to the tier,
        in eviction-policy order (no event: what is cached does not change).

        A leaf with more blocks than needed is split and only its tail moves. Room in the
        tier is made by dropping its own unlocked leaves (evicted, with an "evict" event);
        a node the tier cannot take at all is evicted with its offloaded subtree. Returns
        the pool blocks freed. Detailed listeners get a "demote" per moved run.
        """
        with self._mutex:
            self._requeue_fallen()
            return self._demote(num_blocks)

    def stats(self) -> CacheStats:
        """A consistent snapshot of sizes and counters, the tier's included."""
        with self._mutex:
            return self.counters.freeze(self.pool, self.tier)

    def check_invariants(self, num_private_blocks: int | None = None) -> None:
        """`RadixCache.check_invariants`, plus: offloaded nodes hold tier blocks (each in one
        node, none free), only have offloaded children, and are queued in the tier's queue
        when droppable; the tier's used blocks are exactly the offloaded ones."""
        with self._mutex:
            self._check(num_private_blocks, self.tier, self._tier_queue.nodes())

    # ----------------------------------------------------------------- the tree's hooks

    def _bring_into_pool(
        self, path: list[RadixNode], matched_bytes: int
    ) -> tuple[list[RadixNode], int]:
        """Promote the matched path's offloaded nodes into the pool (allocating there, which
        may demote other nodes); what cannot be promoted is not matched."""
        if not path or not path[-1].offloaded:
            return path, matched_bytes
        path, promoted = self._promote_path(path[-1])
        self.counters.offload_hit_tokens += promoted * self.block_size
        return path, sum(len(node.tokens) for node in path)

    def _adopt(self, path: list[RadixNode], blocks: Sequence[int]) -> None:
        """Offloaded nodes on an inserted path take the caller's pool blocks for their
        tokens (the caller computed the same K/V), and their tier copies are freed."""
        if not path or not path[-1].offloaded:
            return
        i = 0
        for node in path:
            n = len(node.blocks)
            if node.offloaded:
                self._take_pool_blocks(node, list(blocks[i : i + n]))
            i += n

    def _enqueue(self, node: RadixNode) -> None:
        """Queue `node` for eviction from its tier if it is evictable there now."""
        if node.offloaded:
            if is_droppable(node):
                self._tier_queue.push(node)
        else:
            super()._enqueue(node)

    def _drop_blocks(self, node: RadixNode, blocks: list[int], freed: list[int]) -> None:
        """Pool blocks go to `freed` (the caller releases them); tier blocks go back to the
        tier now and count as evicted."""
        if not node.offloaded:
            super()._drop_blocks(node, blocks, freed)
            return
        self.tier.free(blocks)
        self.counters.offloaded_blocks -= len(blocks)
        self.counters.evicted_blocks += len(blocks)

    def _detach(self, node: RadixNode, freed: list[int], events: list[CacheEvent]) -> None:
        """`RadixCache._detach`; a pool parent left with only offloaded children is a pool
        leaf now, so it is queued too."""
        parent = node.parent
        super()._detach(node, freed, events)
        if parent is not None and parent.parent is not None and parent.children:
            self._enqueue(parent)

    def _restore_elsewhere(self, parent: RadixNode | None, record: NodeRecord) -> RadixNode | None:
        """A record the pool did not take goes into the tier, if it has room."""
        node = self._attach_record(parent, record, self.tier)
        if node is not None:
            node.offloaded = True
            self.counters.offloaded_blocks += len(node.blocks)
            self._announce_restored(node)
        return node

    # ----------------------------------------------------------------- moving between tiers

    def _demote(self, num_blocks: int) -> int:
        """Free up to `num_blocks` pool blocks by moving unlocked pool leaves to the tier
        (see `evict`); returns the pool blocks freed."""
        freed: list[int] = []
        events: list[CacheEvent] = []
        moved = 0
        counters = self.counters
        while moved + len(freed) < num_blocks:
            node, over = self._queues.pop_victim()
            if node is None:
                break
            need = num_blocks - moved - len(freed)
            if over:
                need = min(need, over)
            if len(node.blocks) > need:
                self._split(node, len(node.blocks) - need)  # `node` keeps the tail
            tier_blocks = self._tier_allocate(len(node.blocks), events)
            if tier_blocks is None:
                for dead in post_order(node):
                    self._detach(dead, freed, events)
                continue
            self._mover.demote(node.blocks, tier_blocks)
            self.pool.free(node.blocks)
            n = len(node.blocks)
            moved += n
            counters.demoted_blocks += n
            counters.cached_blocks -= n
            counters.offloaded_blocks += n
            self._queues.add_cached(node.namespace, -n)
            dequeue(node)  # making room may have queued it again
            node.blocks = tier_blocks
            node.offloaded = True
            if self._detail_wanted:
                path = decode(node.path_tokens())
                events.append(CacheEvent("demote", node.namespace, path, node.num_tokens, True))
            self._enqueue(node)
            assert node.parent is not None
            self._enqueue(node.parent)
        return self._release(freed, events) + moved

    def _tier_allocate(self, n: int, events: list[CacheEvent]) -> list[int] | None:
        """`n` tier blocks, dropping unlocked offloaded leaves by policy to make room;
        None, dropping nothing more, once no leaf is left to drop."""
        tier = self.tier
        if n > tier.num_total:
            return None
        while tier.num_free < n:
            leaf = self._tier_queue.pop()
            if leaf is None:
                return None
            short = n - tier.num_free
            if len(leaf.blocks) > short:
                self._trim(leaf, short, [], events)
                self._tier_queue.push(leaf)
            else:
                self._detach(leaf, [], events)
        return tier.allocate(n)

    def _promote_path(self, deep: RadixNode) -> tuple[list[RadixNode], int]:
        """Copy the offloaded nodes of the path root..`deep` back into the pool, top down,
        while the pool has room (a node that does not fit is split and its head moves).

        Returns the path's leading run of pool nodes afterwards and the blocks promoted.
        The path is locked meanwhile, so making room never demotes or drops it.
        """
        chain = _path_to(deep)
        promoted = 0
        self.lock(deep)
        try:
            for node in chain:
                if not node.offloaded:
                    continue
                room = self.pool.num_free + self.counters.cached_blocks
                room -= self.counters.locked_blocks
                if room <= 0:
                    break
                whole = len(node.blocks) <= room
                if not whole:
                    node = self._split(node, room)
                try:
                    pool_blocks = self.allocate(len(node.blocks))
                except CacheFullError:
                    break
                self._mover.promote(node.blocks, pool_blocks)
                self._take_pool_blocks(node, pool_blocks)
                promoted += len(pool_blocks)
                if not whole:
                    break  # what is below stays offloaded, and so must its descendants
        finally:
            self.unlock(deep)
        self.counters.promoted_blocks += promoted
        path = _path_to(deep)
        k = 0
        while k < len(path) and not path[k].offloaded:
            k += 1
        return path[:k], promoted

    def _take_pool_blocks(self, node: RadixNode, pool_blocks: list[int]) -> None:
        """Make offloaded `node` a pool node holding `pool_blocks`; free its tier blocks.
        Detailed listeners get a "promote"."""
        self.tier.free(node.blocks)
        self._tier_queue.discard(node)
        n = len(pool_blocks)
        node.blocks = pool_blocks
        node.offloaded = False
        counters = self.counters
        counters.offloaded_blocks -= n
        counters.cached_blocks += n
        self._queues.add_cached(node.namespace, n)
        if node.lock_ref:
            counters.locked_blocks += n
            self._queues.add_locked(node.namespace, n)
        if self._detail_wanted:
            path = decode(node.path_tokens())
            self._emit([CacheEvent("promote", node.namespace, path, node.num_tokens)])


def _path_to(node: RadixNode) -> list[RadixNode]:
    """The nodes from below the root down to `node`."""
    path: list[RadixNode] = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path
