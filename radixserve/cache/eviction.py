"""Which unlocked leaf to evict next: pluggable policies over a lazily maintained heap."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
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
    """An unlocked leaf that is still in the tree and is not a root."""
    return not node.children and node.lock_ref == 0 and not node.removed and node.parent is not None


class EvictionQueue:
    """A min-heap of evictable leaves by policy key, with lazy deletion.

    Each node has at most one entry (`node.in_heap`). Entries are not removed when a
    node is touched, locked or given a child; `pop` drops or re-keys stale entries
    when they reach the top. Entries of pruned nodes are discarded and compacted away,
    so the heap never grows beyond about twice the number of nodes.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heap: list[tuple[EvictionKey, int, RadixNode]] = []
        self._seq = itertools.count()  # tie-breaker, so nodes are never compared
        self._live = 0  # entries whose node has in_heap set

    def __len__(self) -> int:
        return self._live

    def push(self, node: RadixNode) -> None:
        """Add `node` unless it already has an entry (the caller knows it is evictable)."""
        if node.in_heap:
            return
        node.in_heap = True
        self._live += 1
        heapq.heappush(self._heap, (self.policy.key(node), next(self._seq), node))

    def discard(self, node: RadixNode) -> None:
        """Forget `node` (it is being pruned); its entry is dropped later."""
        if not node.in_heap:
            return
        node.in_heap = False
        self._live -= 1
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [entry for entry in self._heap if entry[2].in_heap]
            heapq.heapify(self._heap)

    def pop(self) -> RadixNode | None:
        """Remove and return the evictable leaf with the smallest key, or None if none is."""
        heap = self._heap
        key_of = self.policy.key
        while heap:
            key, _, node = heap[0]
            if not node.in_heap:
                heapq.heappop(heap)
                continue
            if not is_evictable(node):
                heapq.heappop(heap)
                node.in_heap = False
                self._live -= 1
                continue
            current = key_of(node)
            if current != key:
                heapq.heapreplace(heap, (current, next(self._seq), node))
                continue
            heapq.heappop(heap)
            node.in_heap = False
            self._live -= 1
            return node
        return None

    def nodes(self) -> list[RadixNode]:
        """Nodes with a live entry (for invariant checks)."""
        return [entry[2] for entry in self._heap if entry[2].in_heap]
