"""Which unlocked leaf to evict next: pluggable policies over a lazily maintained heap."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeAlias

from radixserve.cache.node import RadixNode

EvictionKey: TypeAlias = tuple[float, ...]
"""A leaf's eviction priority: the smallest key is evicted first."""


class EvictionPolicy(ABC):
    """Orders evictable leaves. Subclass it and implement `key` to add a policy.

    The queue re-reads a leaf's key only when the leaf reaches the top of the heap,
    so a key may grow between reads (a touch makes a leaf newer) but should not
    shrink while the node is unchanged, or that leaf is evicted later than it should.
    Keys only get compared to each other, never to a node.
    """

    @abstractmethod
    def key(self, node: RadixNode) -> EvictionKey:
        """The priority of leaf `node`; smaller keys are evicted first."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def key(self, node: RadixNode) -> EvictionKey:
        """Last access time alone."""
        return (node.last_access,)


class PriorityLRUPolicy(EvictionPolicy):
    """Lowest priority tier first, least recently used first within a tier."""

    def key(self, node: RadixNode) -> EvictionKey:
        """Node priority (set by `insert`), then last access time."""
        return (node.priority, node.last_access)


def is_evictable(node: RadixNode) -> bool:
    """An unlocked pool leaf that is still in the tree and is not a root.

    A pool leaf is a node in the pool whose children (if any) are all offloaded.
    """
    return (
        node.lock_ref == 0
        and not node.offloaded
        and not node.removed
        and node.parent is not None
        and (not node.children or all(c.offloaded for c in node.children.values()))
    )


def is_droppable(node: RadixNode) -> bool:
    """An unlocked offloaded leaf still in the tree: what the offload tier evicts."""
    return node.offloaded and not node.children and node.lock_ref == 0 and not node.removed


Entry: TypeAlias = tuple[EvictionKey, int, RadixNode, "EvictionQueue"]
"""A heap entry: key, tie-breaker, node, and the queue it belongs to."""


class EvictionQueue:
    """A min-heap of evictable leaves by policy key, with lazy deletion.

    Each node has at most one live entry: the one `node.in_heap` is (a cache with an
    offload tier has a second queue, and a node is live in at most one of them).
    Entries are not removed when a node is touched, locked or given a child; `pop`
    drops or re-keys stale entries when they reach the top. Discarded entries are
    compacted away, so the heap never grows beyond about twice the number of nodes.
    """

    def __init__(
        self, policy: EvictionPolicy, evictable: Callable[[RadixNode], bool] = is_evictable
    ) -> None:
        self.policy = policy
        self.evictable = evictable
        self._heap: list[Entry] = []
        self._seq = itertools.count()  # tie-breaker, so nodes are never compared
        self._live = 0  # entries that are their node's `in_heap`

    def __len__(self) -> int:
        return self._live

    def push(self, node: RadixNode) -> None:
        """Add `node` unless it already has an entry here (the caller knows it is
        evictable); a live entry in another queue is discarded first."""
        entry: Entry | None = node.in_heap
        if entry is not None:
            if entry[3] is self:
                return
            entry[3].discard(node)
        self._add(node)

    def discard(self, node: RadixNode) -> None:
        """Forget `node`'s entry here, if it has one; the entry is dropped later."""
        entry: Entry | None = node.in_heap
        if entry is None or entry[3] is not self:
            return
        node.in_heap = None
        self._live -= 1
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [e for e in self._heap if e[2].in_heap is e]
            heapq.heapify(self._heap)

    def pop(self) -> RadixNode | None:
        """Remove and return the evictable leaf with the smallest key, or None if none is."""
        heap = self._heap
        key_of = self.policy.key
        evictable = self.evictable
        while heap:
            entry = heap[0]
            node = entry[2]
            if node.in_heap is not entry:
                heapq.heappop(heap)
                continue
            heapq.heappop(heap)
            node.in_heap = None
            self._live -= 1
            if not evictable(node):
                continue
            if key_of(node) != entry[0]:
                self._add(node)
                continue
            return node
        return None

    def nodes(self) -> list[RadixNode]:
        """Nodes with a live entry (for invariant checks)."""
        return [e[2] for e in self._heap if e[2].in_heap is e]

    def _add(self, node: RadixNode) -> None:
        entry = (self.policy.key(node), next(self._seq), node, self)
        node.in_heap = entry
        self._live += 1
        heapq.heappush(self._heap, entry)
