"""Which pool leaf to evict next across namespaces, and the per-namespace counts a quota reads."""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from radixserve.cache.errors import InvariantError
from radixserve.cache.eviction import EvictionKey, EvictionPolicy, EvictionQueue
from radixserve.cache.node import RadixNode
from radixserve.cache.trie import post_order


class NamespaceQueues:
    """The pool's eviction queues and how many pool blocks each namespace holds and locks.

    Without a quota every pool leaf waits in one queue. With `quota_blocks` q, each
    namespace has its own queue, and a namespace holding more than q unlocked blocks gives
    its leaves first, down to q, before any other namespace loses a block. The counts are
    kept either way (`check_counts` compares them with the tree).
    """

    def __init__(self, policy: EvictionPolicy, quota_blocks: int | None) -> None:
        self.policy = policy
        self.quota_blocks = quota_blocks
        self._queues: dict[Hashable, EvictionQueue] = {}
        self._cached: dict[Hashable, int] = {}
        self._locked: dict[Hashable, int] = {}

    def add_cached(self, namespace: Hashable, n: int) -> None:
        """`namespace` holds `n` more pool blocks (fewer when negative)."""
        self._cached[namespace] = self._cached.get(namespace, 0) + n

    def add_locked(self, namespace: Hashable, n: int) -> None:
        """`n` more of `namespace`'s pool blocks are locked (fewer when negative)."""
        self._locked[namespace] = self._locked.get(namespace, 0) + n

    def forget(self, namespace: Hashable) -> None:
        """Drop the queue and counts of a namespace that no longer holds anything."""
        self._cached.pop(namespace, None)
        self._locked.pop(namespace, None)
        self._queues.pop(namespace, None)

    def push(self, node: RadixNode) -> None:
        """Queue evictable pool leaf `node` (no-op if it is queued already)."""
        ns = node.namespace if self.quota_blocks is not None else None
        queue = self._queues.get(ns)
        if queue is None:
            queue = self._queues[ns] = EvictionQueue(self.policy)
        queue.push(node)

    def pop_victim(self) -> tuple[RadixNode | None, int]:
        """Pop the leaf to evict next and, when its namespace is over its quota, by how many
        blocks it is over (else 0): from the most-over namespace, else the smallest key."""
        quota = self.quota_blocks
        if quota is not None:
            over = []
            for ns, cached in self._cached.items():
                excess = cached - self._locked.get(ns, 0) - quota
                if excess > 0 and ns in self._queues:
                    over.append((excess, ns))
            for excess, ns in sorted(over, key=lambda e: -e[0]):
                node = self._queues[ns].pop()
                if node is not None:
                    return node, excess
        best: EvictionQueue | None = None
        best_key: EvictionKey | None = None
        for queue in self._queues.values():
            key = queue.peek()
            if key is not None and (best_key is None or key < best_key):
                best, best_key = queue, key
        return (best.pop() if best is not None else None), 0

    def nodes(self) -> list[RadixNode]:
        """Every queued node (for invariant checks and tests)."""
        return [node for queue in self._queues.values() for node in queue.nodes()]

    def check_counts(self, roots: Iterable[tuple[Hashable, RadixNode]]) -> None:
        """Raise InvariantError unless each namespace's counts match its tree under `roots`
        ((namespace, root) pairs); offloaded nodes hold no pool blocks."""
        for ns, root in roots:
            cached = locked = 0
            for node in post_order(root):
                if node is not root and not node.offloaded:
                    cached += len(node.blocks)
                    locked += len(node.blocks) if node.lock_ref else 0
            if self._cached.get(ns, 0) != cached or self._locked.get(ns, 0) != locked:
                raise InvariantError(
                    f"namespace {ns!r}: counted {self._cached.get(ns, 0)} cached / "
                    f"{self._locked.get(ns, 0)} locked blocks, tree has {cached} / {locked}"
                )
