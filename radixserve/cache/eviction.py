"""Which unlocked leaf to evict next: the policy interface and lazily maintained heaps."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TypeAlias

from radixserve.cache.node import RadixNode

EvictionKey: TypeAlias = tuple[float, ...]
"""A leaf's eviction priority: the smallest key is evicted first."""


class EvictionPolicy(ABC):
    """Orders evictable leaves. Subclass it, implement `key`, and override the hooks it needs.

    The queue re-reads a leaf's key only when the leaf reaches the top of the heap, so a
    key may grow at any time (a hit makes a leaf worth more). A key that shrinks must be
    reported through `fallen`, or that leaf is evicted later than it should be. Keys are
    only compared with each other, never with a node. The cache calls every hook under its
    lock; a policy instance serves one cache (`bind` tells it the pool size).
    """

    name = "custom"

    @abstractmethod
    def key(self, node: RadixNode) -> EvictionKey:
        """The priority of leaf `node`; smaller keys are evicted first."""

    def bind(self, num_blocks: int) -> None:
        """Called once by the cache that uses this policy, with its pool size."""
        return None  # a hook: policies that need it override it

    def on_hit(self, path: Sequence[RadixNode], tick: int) -> None:
        """A lookup matched `path` (root side first) at logical time `tick`."""
        return None  # a hook: policies that need it override it

    def on_insert(
        self,
        path: Sequence[RadixNode],
        new: RadixNode | None,
        tick: int,
        session: bool,
        reused: bool,
    ) -> None:
        """An insert covered `path` at `tick`; `new` is the leaf it created (if any);
        `session`: the request carried a session id; `reused`: some of `new`'s blocks were
        evicted shortly before (a ghost hit: the path is in use again)."""
        return None  # a hook: policies that need it override it

    def on_split(self, upper: RadixNode, lower: RadixNode) -> None:
        """`upper` was split off the front of `lower`; the cache already copied the
        node fields (access time, priority, score, segment, warm time) to `upper`."""
        return None  # a hook: policies that need it override it

    def on_drop(self, node: RadixNode, num_blocks: int) -> None:
        """`num_blocks` of `node`'s blocks were evicted (all of them when `node.removed`)."""
        return None  # a hook: policies that need it override it

    def fallen(self) -> Sequence[RadixNode]:
        """Nodes whose key shrank since the last call (the cache re-queues them)."""
        return ()


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def key(self, node: RadixNode) -> EvictionKey:
        """Last access time alone."""
        return (node.last_access,)


class PriorityLRUPolicy(EvictionPolicy):
    """Lowest priority tier first, least recently used first within a tier."""

    name = "priority"

    def key(self, node: RadixNode) -> EvictionKey:
        """Node priority (the highest tier that inserted through it), then last access."""
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


def dequeue(node: RadixNode) -> None:
    """Drop `node`'s live entry from whichever `EvictionQueue` holds it (if any)."""
    entry = node.in_heap
    if entry is not None:
        entry[3].discard(node)


Entry: TypeAlias = tuple[EvictionKey, int, RadixNode, "EvictionQueue"]
"""A heap entry: key, tie-breaker, node, and the queue it belongs to."""


class EvictionQueue:
    """A min-heap of evictable leaves by policy key, with lazy deletion.

    Each node has at most one live entry: the one `node.in_heap` is (a cache with an
    offload tier has a second queue for offloaded leaves, ordered by the same policy,
    and a node is live in at most one of them). Entries are not removed when a node is
    touched, locked or given a child; stale or re-keyed entries are dropped or refreshed
    when they reach the top. Entries of pruned or re-queued nodes are compacted away, so
    the heap stays about twice the live count.
    """

    def __init__(
        self, policy: EvictionPolicy, evictable: Callable[[RadixNode], bool] = is_evictable
    ) -> None:
        self.policy = policy
        self.evictable = evictable  # which nodes this queue may hand out
        self._heap: list[Entry] = []
        self._seq = itertools.count()  # tie-breaker, so nodes are never compared
        self._live = 0  # entries that are their node's `in_heap`

    def __len__(self) -> int:
        return self._live

    def owns(self, node: RadixNode) -> bool:
        """`node` has its live entry in this queue."""
        entry: Entry | None = node.in_heap
        return entry is not None and entry[3] is self

    def push(self, node: RadixNode) -> None:
        """Add `node` unless it already has an entry here (the caller knows it is
        evictable); a live entry in another queue is discarded first."""
        entry: Entry | None = node.in_heap
        if entry is not None:
            if entry[3] is self:
                return
            entry[3].discard(node)
        self._live += 1
        self._add(node)

    def requeue(self, node: RadixNode) -> None:
        """Re-read `node`'s key now (it shrank); no-op unless `node` has an entry here."""
        if self.owns(node):
            self._add(node)
            self._compact()

    def discard(self, node: RadixNode) -> None:
        """Forget `node`'s entry here, if it has one; the entry is dropped later."""
        if not self.owns(node):
            return
        node.in_heap = None
        self._live -= 1
        self._compact()

    def peek(self) -> EvictionKey | None:
        """The smallest current key of an evictable leaf, or None; drops stale entries."""
        heap = self._heap
        key_of = self.policy.key
        evictable = self.evictable
        while heap:
            entry = heap[0]
            node = entry[2]
            if node.in_heap is not entry:
                heapq.heappop(heap)
                continue
            if not evictable(node):
                heapq.heappop(heap)
                node.in_heap = None
                self._live -= 1
                continue
            current = key_of(node)
            if current != entry[0]:
                heapq.heappop(heap)
                self._add(node)
                continue
            return current
        return None

    def pop(self) -> RadixNode | None:
        """Remove and return the evictable leaf with the smallest key, or None if none is."""
        if self.peek() is None:
            return None
        node = heapq.heappop(self._heap)[2]
        node.in_heap = None
        self._live -= 1
        return node

    def nodes(self) -> list[RadixNode]:
        """Nodes with a live entry here (for invariant checks)."""
        return [e[2] for e in self._heap if e[2].in_heap is e]

    def _add(self, node: RadixNode) -> None:
        """Push a fresh entry for `node` and make it the live one (the count is unchanged)."""
        entry: Entry = (self.policy.key(node), next(self._seq), node, self)
        node.in_heap = entry
        heapq.heappush(self._heap, entry)

    def _compact(self) -> None:
        if len(self._heap) > 2 * self._live + 64:
            self._heap = [e for e in self._heap if e[2].in_heap is e]
            heapq.heapify(self._heap)
