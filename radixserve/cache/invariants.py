"""The cache's invariants (docs/architecture.md) as code; tests and debug mode call it."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.cache.counters import CacheCounters
from radixserve.cache.errors import InvariantError
from radixserve.cache.eviction import is_droppable, is_evictable
from radixserve.cache.node import RadixNode
from radixserve.cache.pool import BlockPool
from radixserve.cache.tokens import TOKEN_BYTES


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)


def check_tree(
    roots: list[RadixNode],
    heap_nodes: list[RadixNode],
    pool: BlockPool,
    block_size: int,
    counters: CacheCounters,
    num_private_blocks: int | None,
    tier: BlockPool | None = None,
    tier_heap_nodes: list[RadixNode] | None = None,
) -> None:
    """Walk every tree and raise InvariantError at the first broken invariant.

    Checks node shapes, keys, parent links, lock counts (a parent holds at least the
    sum of its children's), monotone access time and priority along paths, block
    ownership (each block in at most one node, none of them free in the pool), the
    cache's size counters, that every unlocked leaf is queued for eviction, and, when
    `num_private_blocks` is given, free + cached + private == total. With an offload
    `tier`: offloaded nodes hold tier blocks (each in one node, none free), only have
    offloaded children, and are queued in `tier_heap_nodes` when droppable; the tier's
    used blocks are exactly the offloaded ones.
    """
    queued, tier_queued = _check_queues(heap_nodes, tier_heap_nodes or [])
    walk = _TreeWalk(block_size * TOKEN_BYTES, pool, tier, queued, tier_queued)
    for root in roots:
        walk.check_root(root)
    if tier is not None:
        _require(tier.num_used == len(walk.tier_owner), "tier blocks are used outside the tree")
    _check_counters(counters, walk)
    _check_pool_accounting(pool, len(walk.owner), num_private_blocks)


def _check_queues(
    heap_nodes: list[RadixNode], tier_heap_nodes: list[RadixNode]
) -> tuple[set[int], set[int]]:
    """The ids of the nodes queued for eviction from the pool and for dropping from the tier,
    each node queued once, in the queue of its own tier."""
    queued = {id(node) for node in heap_nodes}
    _require(len(queued) == len(heap_nodes), "a node is queued for eviction twice")
    tier_queued = {id(node) for node in tier_heap_nodes}
    _require(not tier_queued & queued, "a node is queued in both tiers")
    _require(not any(n.offloaded for n in heap_nodes), "an offloaded node is in the pool queue")
    _require(all(n.offloaded for n in tier_heap_nodes), "a pool node is in the tier queue")
    return queued, tier_queued


@dataclass
class _TreeWalk:
    """One walk over the trees: checks each node as it goes and tallies what the cache's
    counters must equal."""

    block_bytes: int
    pool: BlockPool
    tier: BlockPool | None
    queued: set[int]  # ids of the nodes in the pool's eviction queue
    tier_queued: set[int]  # ids of the nodes in the tier's drop queue
    owner: dict[int, RadixNode] = field(default_factory=dict)  # pool block -> its node
    tier_owner: dict[int, RadixNode] = field(default_factory=dict)  # tier block -> its node
    locked_blocks: int = 0
    num_nodes: int = 0

    def check_root(self, root: RadixNode) -> None:
        """Check `root` and every node below it."""
        _require(root.parent is None and not root.removed, "a root has a parent or is removed")
        _require(root.tokens == b"" and root.blocks == [], "a root holds tokens or blocks")
        _require(root.lock_ref == 0, "a root has a lock count")
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for key, child in node.children.items():
                self.num_nodes += 1
                stack.append(child)
                child_locks += child.lock_ref
                self._check_child(root, node, key, child)
            if node is not root:
                _require(
                    child_locks <= node.lock_ref,
                    f"node {node!r}: locked less than its children (an ancestor is unlocked)",
                )

    def _check_child(self, root: RadixNode, node: RadixNode, key: bytes, child: RadixNode) -> None:
        """Check `child` of `node` (its shape, order along the path, queue and blocks) and
        tally its locked blocks."""
        where = f"node {child!r}"
        self._check_shape(root, node, key, child, where)
        if node is not root:
            _require(child.last_access <= node.last_access, f"{where}: newer than parent")
            _require(child.priority <= node.priority, f"{where}: outranks its parent")
        if child.lock_ref > 0:
            self.locked_blocks += len(child.blocks)
        if is_evictable(child):
            _require(id(child) in self.queued, f"{where}: unlocked leaf not queued")
        if is_droppable(child):
            _require(id(child) in self.tier_queued, f"{where}: offloaded leaf not queued")
        _require(child.offloaded or not node.offloaded, f"{where}: in the pool below the tier")
        self._claim_blocks(child, where)

    def _check_shape(
        self, root: RadixNode, node: RadixNode, key: bytes, child: RadixNode, where: str
    ) -> None:
        """`child` is linked to `node`, in `root`'s namespace, keyed by its first block, and
        holds a whole number of blocks."""
        block_bytes = self.block_bytes
        _require(child.parent is node, f"{where}: parent link is broken")
        _require(not child.removed, f"{where}: removed but still in the tree")
        _require(child.namespace == root.namespace, f"{where}: wrong namespace")
        _require(
            len(child.tokens) > 0 and len(child.tokens) % block_bytes == 0,
            f"{where}: run is not a positive whole number of blocks",
        )
        _require(
            len(child.tokens) // block_bytes == len(child.blocks),
            f"{where}: run length != len(blocks) * block_size",
        )
        _require(key == child.tokens[:block_bytes], f"{where}: key != first block")
        _require(child.lock_ref >= 0, f"{where}: negative lock count")

    def _claim_blocks(self, child: RadixNode, where: str) -> None:
        """Record `child` as the owner of its blocks, each lent by its tier and owned once."""
        home, owners = (self.tier, self.tier_owner) if child.offloaded else (self.pool, self.owner)
        _require(home is not None, f"{where}: offloaded without a tier")
        assert home is not None
        for block_id in child.blocks:
            _require(0 <= block_id < home.num_total, f"{where}: block {block_id} not in pool")
            _require(not home.is_free(block_id), f"{where}: block {block_id} is free")
            _require(block_id not in owners, f"{where}: block {block_id} is shared")
            owners[block_id] = child


def _check_counters(counters: CacheCounters, walk: _TreeWalk) -> None:
    """The cache's size counters equal what the walk found."""
    for name, counted, value in [
        ("cached_blocks", counters.cached_blocks, len(walk.owner)),
        ("locked_blocks", counters.locked_blocks, walk.locked_blocks),
        ("num_nodes", counters.num_nodes, walk.num_nodes),
        ("offloaded_blocks", counters.offloaded_blocks, len(walk.tier_owner)),
    ]:
        _require(counted == value, f"counter {name}={counted} but tree has {value}")


def _check_pool_accounting(
    pool: BlockPool, cached_blocks: int, num_private_blocks: int | None
) -> None:
    """The pool lent at least the tree's blocks; with `num_private_blocks`, every block is
    free, cached or private."""
    _require(pool.num_used >= cached_blocks, "the tree holds more blocks than the pool lent")
    if num_private_blocks is not None:
        total = pool.num_free + cached_blocks + num_private_blocks
        _require(
            total == pool.num_total,
            f"free {pool.num_free} + cached {cached_blocks} + private {num_private_blocks}"
            f" != total {pool.num_total}",
        )
