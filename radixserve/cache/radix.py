"""The radix prefix cache: token-id prefixes -> KV blocks, at block granularity."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from radixserve.cache.errors import CacheFullError, InvariantError
from radixserve.cache.eviction import (
    EvictionKey,
    EvictionPolicy,
    EvictionQueue,
    LRUPolicy,
    is_droppable,
    is_evictable,
)
from radixserve.cache.invariants import check_tree
from radixserve.cache.mirror import apply_event
from radixserve.cache.node import RadixNode
from radixserve.cache.pool import BlockPool
from radixserve.cache.refetch import RefetchTracker
from radixserve.cache.snapshot import TreeSnapshot, take_snapshot
from radixserve.cache.tokens import TOKEN_BYTES, LazyQuery, TokenIds, decode, encode
from radixserve.cache.trie import path_blocks, post_order, walk
from radixserve.cache.types import (
    BlockMover,
    CacheEvent,
    CacheStats,
    InsertResult,
    MatchResult,
    NodeRecord,
)

logger = logging.getLogger(__name__)

Listener = Callable[[CacheEvent], None]


class RadixCache:
    """A compressed trie of token ids whose nodes own the KV blocks of their tokens.

    Only whole blocks of `block_size` tokens are cached. Blocks come from `pool`; the
    tree owns exactly one block per cached token block and returns blocks to the pool
    when it evicts. Each namespace has its own root, so entries are never shared across
    namespaces. Every public method holds one re-entrant lock, so other threads may call
    `peek_prefix` and `stats` while the engine thread mutates the cache.

    `policy` orders evictions (a fresh instance per cache; default LRU). With
    `namespace_quota` q, a namespace holding more than q of the pool in unlocked blocks is
    evicted from first, down to q, before any other namespace loses a block. Blocks cached
    again within `refetch_window_s` seconds (of `clock`) of their eviction are counted as
    refetched (0 turns the count off).

    With an offload `tier` (a second block pool) and a `mover` for the bytes, evicting
    from `pool` demotes nodes to the tier instead of dropping them, and the tier drops
    its own leaves by the same policy (see docs/kv-offload.md).
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int = 16,
        policy: EvictionPolicy | None = None,
        tier: BlockPool | None = None,
        mover: BlockMover | None = None,
        *,
        namespace_quota: float | None = None,
        refetch_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if namespace_quota is not None and not 0.0 < namespace_quota <= 1.0:
            raise ValueError(f"namespace_quota must be in (0, 1], got {namespace_quota}")
        if (tier is None) != (mover is None):
            raise ValueError("an offload tier needs a mover, and a mover a tier")
        self.pool = pool
        self.tier = tier
        self._mover = mover
        self.block_size = block_size
        self._block_bytes = block_size * TOKEN_BYTES
        self._policy = policy or LRUPolicy()
        self._policy.bind(pool.num_total)
        self._quota_blocks = (
            None if namespace_quota is None else int(namespace_quota * pool.num_total)
        )
        # one queue per namespace with a quota (it evicts within one), else one for all
        self._queues: dict[Hashable, EvictionQueue] = {}
        self._ns_cached: dict[Hashable, int] = {}
        self._ns_locked: dict[Hashable, int] = {}
        self._refetch = (
            RefetchTracker(refetch_window_s, clock, 8 * pool.num_total)
            if refetch_window_s > 0
            else None
        )
        self._tier_queue = EvictionQueue(self._policy, is_droppable)  # offloaded leaves
        self._roots: dict[Hashable, RadixNode] = {None: RadixNode(b"", [], None, None)}
        self._listeners: list[Listener] = []
        self._lock = threading.RLock()
        self._clock = 0
        self._cached_blocks = 0
        self._locked_blocks = 0
        self._num_nodes = 0
        self._lookups = 0
        self._hit_tokens = 0
        self._missed_tokens = 0
        self._inserts = 0
        self._inserted_blocks = 0
        self._evicted_blocks = 0
        self._offloaded_blocks = 0
        self._demoted_blocks = 0
        self._promoted_blocks = 0
        self._offload_hit_tokens = 0

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy ordering unlocked leaves."""
        return self._policy

    @property
    def namespace_quota_blocks(self) -> int | None:
        """Unlocked blocks one namespace may keep at others' expense (None: no quota)."""
        return self._quota_blocks

    # ----------------------------------------------------------------- lookups

    def match_prefix(self, token_ids: TokenIds, namespace: Hashable = None) -> MatchResult:
        """Find the longest cached prefix of `token_ids` made of whole blocks.

        Side effects: if the match ends inside a node, that node is split at the block
        boundary (the returned node is the new upper half); every node on the matched
        path gets a new last-access time; the hit/miss counters grow. With an offload
        tier, matched offloaded nodes are promoted back into the pool first (allocating
        there, which may demote other nodes); what cannot be promoted is not matched.
        The nodes of the returned match get one more hit and the policy hears of it.
        Lock the returned node before the blocks may be evicted (before the next
        `evict` or `allocate`).
        """
        with self._lock:
            self._lookups += 1
            root = self._roots.get(namespace)
            if root is None:
                self._missed_tokens += len(token_ids)
                return MatchResult(0, [], RadixNode(b"", [], None, namespace))
            query = LazyQuery(token_ids, len(token_ids) // self.block_size * self.block_size)
            path, matched, child, k = walk(root, self._block_bytes, query)
            if child is not None:
                path.append(self._split(child, k))
                matched += k * self._block_bytes
            self._clock += 1
            tick = self._clock
            for node in path:
                node.last_access = tick
            if path and path[-1].offloaded:
                path, promoted = self._promote_path(path[-1])
                matched = sum(len(node.tokens) for node in path)
                self._offload_hit_tokens += promoted * self.block_size
            now = time.monotonic()
            for node in path:
                node.access_time = now
                node.hit_count += 1
            if path:
                self._policy.on_hit(path, tick)
            blocks = path_blocks(path)
            num_tokens = matched // TOKEN_BYTES
            self._hit_tokens += num_tokens
            self._missed_tokens += len(token_ids) - num_tokens
            return MatchResult(num_tokens, blocks, path[-1] if path else root)

    def peek_prefix(self, token_ids: TokenIds, namespace: Hashable = None) -> int:
        """How many leading tokens of `token_ids` are cached (whole blocks).

        Read-only: no split, no access-time update, no statistics.
        """
        with self._lock:
            root = self._roots.get(namespace)
            if root is None:
                return 0
            query = LazyQuery(token_ids, len(token_ids) // self.block_size * self.block_size)
            _, matched, _, k = walk(root, self._block_bytes, query)
            return matched // TOKEN_BYTES + k * self.block_size

    # ----------------------------------------------------------------- mutation

    def insert(
        self,
        token_ids: TokenIds,
        blocks: Sequence[int],
        namespace: Hashable = None,
        priority: int = 0,
        session: bool = False,
    ) -> InsertResult:
        """Cache `token_ids` (len == len(blocks) * block_size) whose KV lives in `blocks`.

        The tree takes the caller's blocks only for the tokens that were not cached yet;
        for the already-cached prefix it keeps its own, and `duplicate_blocks` lists the
        caller's blocks there that the caller must free. Splits a node where the path
        diverges inside it. Side effects: the whole path gets a new access time and
        priority max(old, `priority`), and the policy hears of it (`session`: the request
        carried a session id); newly cached blocks evicted shortly before count as
        refetched; listeners get an "insert" event if tokens were added.
        """
        bs = self.block_size
        if len(token_ids) != len(blocks) * bs:
            raise ValueError(
                f"len(token_ids)={len(token_ids)} != len(blocks)*block_size={len(blocks) * bs}"
            )
        if not self.pool.all_used(blocks):
            raise ValueError("insert needs blocks allocated from this cache's pool")
        with self._lock:
            root = self._roots.get(namespace)
            if root is None:
                root = self._roots[namespace] = RadixNode(b"", [], None, namespace)
            query = LazyQuery(token_ids, len(token_ids))
            path, matched, child, k = walk(root, self._block_bytes, query)
            if child is not None:
                path.append(self._split(child, k))
                matched += k * self._block_bytes
            num_cached = matched // self._block_bytes
            if path and path[-1].offloaded:
                self._adopt(path, blocks)
            tree_blocks = path_blocks(path)
            mine = blocks[: len(tree_blocks)]
            duplicates = [b for b, t in zip(mine, tree_blocks, strict=True) if b != t]
            self._clock += 1
            tick = self._clock
            events: list[CacheEvent] = []
            leaf: RadixNode | None = None
            reused = False
            if num_cached < len(blocks):
                data = query.ensure(query.limit_bytes)
                parent = path[-1] if path else root
                leaf = RadixNode(data[matched:], list(blocks[num_cached:]), parent, namespace)
                parent.children[data[matched : matched + self._block_bytes]] = leaf
                path.append(leaf)
                self._num_nodes += 1
                self._cached_blocks += len(leaf.blocks)
                self._ns_cached[namespace] = self._ns_cached.get(namespace, 0) + len(leaf.blocks)
                self._inserted_blocks += len(leaf.blocks)
                if self._refetch is not None:
                    reused = (
                        self._refetch.inserted(
                            namespace, data, num_cached, len(data), self._block_bytes
                        )
                        > 0
                    )
                if self._listeners:
                    events.append(
                        CacheEvent("insert", namespace, tuple(token_ids), leaf.num_tokens)
                    )
            now = time.monotonic()
            for node in path:
                node.last_access = tick
                node.access_time = now
                if node.priority < priority:
                    node.priority = priority
            if path:
                self._policy.on_insert(path, leaf, tick, session, reused)
            if path:
                self._enqueue(path[-1])
            self._inserts += 1
            self._emit(events)
            return InsertResult(num_cached * bs, path[-1] if path else root, duplicates)

    def lock(self, node: RadixNode) -> None:
        """Pin the path root..`node`: none of it is evicted until a matching `unlock`.

        Locks nest (a count per node). Locking a root is a no-op. Raises ValueError if
        the node was evicted.
        """
        with self._lock:
            if node.removed:
                raise ValueError("cannot lock a node that was evicted")
            ns_locked = self._ns_locked
            while node.parent is not None:
                if node.lock_ref == 0 and not node.offloaded:
                    self._locked_blocks += len(node.blocks)
                    ns_locked[node.namespace] = ns_locked.get(node.namespace, 0) + len(node.blocks)
                node.lock_ref += 1
                node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`; unpinned leaves become evictable.

        Raises ValueError if `node` is not locked (the count would go below zero).
        """
        with self._lock:
            if node.parent is not None and node.lock_ref <= 0:
                raise ValueError("unlock of a node that is not locked")
            while node.parent is not None:
                node.lock_ref -= 1
                if node.lock_ref == 0:
                    if not node.offloaded:
                        self._locked_blocks -= len(node.blocks)
                        self._ns_locked[node.namespace] -= len(node.blocks)
                    self._enqueue(node)
                node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks from unlocked leaves, in eviction-policy order.

        Returns how many were freed (fewer only if fewer are evictable). With a namespace
        quota, namespaces over it give their blocks first. A leaf with more blocks than
        still needed loses only its tail blocks. A parent left as an unlocked leaf may be
        evicted in the same call. Freed blocks go back to the pool; listeners get one
        "evict" event per removed run. With an offload tier the nodes are demoted instead
        (no event), in the same order, and only what the tier drops to make room is
        evicted.
        """
        with self._lock:
            for fell in self._policy.fallen():
                self._requeue(fell)
            if self.tier is not None:
                return self._demote(num_blocks)
            freed: list[int] = []
            events: list[CacheEvent] = []
            while len(freed) < num_blocks:
                need = num_blocks - len(freed)
                victim, over = self._next_victim()
                if victim is None:
                    break
                if over:
                    need = min(need, over)
                if len(victim.blocks) > need:
                    self._trim(victim, need, freed, events)
                    self._queue_of(victim).push(victim)
                else:
                    self._detach(victim, freed, events)
            return self._release(freed, events)

    def evict_path(self, token_ids: TokenIds, namespace: Hashable = None) -> int:
        """Remove the cached subtree rooted at the last block of `token_ids`.

        `token_ids` must be a non-empty whole number of blocks. Every unlocked node whose
        path starts with all of `token_ids` is removed and its blocks are freed; locked
        ones stay. Returns the number of pool blocks freed (0 if the path is not fully
        cached); offloaded nodes of the subtree are dropped from the tier as well.
        """
        num_bytes = len(token_ids) * TOKEN_BYTES
        if num_bytes == 0 or num_bytes % self._block_bytes:
            raise ValueError("evict_path needs a non-empty whole number of blocks")
        with self._lock:
            root = self._roots.get(namespace)
            if root is None:
                return 0
            query = LazyQuery(token_ids, len(token_ids))
            path, matched, child, k = walk(root, self._block_bytes, query)
            if child is None:
                if matched < num_bytes:
                    return 0
                child, k = path[-1], len(path[-1].blocks)
            elif matched + k * self._block_bytes < num_bytes:
                return 0
            if k > 1:
                self._split(child, k - 1)  # `child` keeps the last block of the path
            freed: list[int] = []
            events: list[CacheEvent] = []
            stack = [child]
            while stack:
                node = stack.pop()
                if node.lock_ref:
                    stack.extend(node.children.values())
                    continue
                for dead in post_order(node):
                    self._detach(dead, freed, events)
            return self._release(freed, events)

    def allocate(self, num_blocks: int) -> list[int]:
        """Allocate blocks from the pool, evicting first if the pool is short.

        Raises CacheFullError, evicting nothing, if free plus evictable blocks are too few.
        """
        with self._lock:
            short = num_blocks - self.pool.num_free
            if short > 0:
                evictable = self._cached_blocks - self._locked_blocks
                if short > evictable:
                    raise CacheFullError(num_blocks, self.pool.num_free + evictable)
                self.evict(short)
            return self.pool.allocate(num_blocks)

    def apply_event(self, event: CacheEvent) -> None:
        """Replay another cache's event here, to mirror what it caches (see `mirror.py`)."""
        apply_event(self, event)

    # ----------------------------------------------------------------- observers

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(event)` after every change of the cached set, under the cache lock.

        A listener may read this cache (the lock is re-entrant) but must not mutate it or
        wait on another thread that uses it. Exceptions it raises are logged and
        swallowed, so one bad listener cannot break the cache or the other listeners.
        """
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling `listener`; raises ValueError if it was not added."""
        with self._lock:
            self._listeners.remove(listener)

    def leaf_paths(self) -> list[tuple[Hashable, tuple[int, ...]]]:
        """(namespace, token ids from the root) of every leaf: a snapshot of what is cached.

        Walks the whole tree under the lock; for snapshots and tests, not the hot path.
        """
        out: list[tuple[Hashable, tuple[int, ...]]] = []
        with self._lock:
            for namespace, root in self._roots.items():
                for node in post_order(root):
                    if not node.children and node is not root:
                        out.append((namespace, decode(node.path_tokens())))
        return out

    def snapshot(self, head_tokens: int = 32) -> TreeSnapshot:
        """A copy of every node's shape and counters, for observers (see `snapshot.py`).

        Holds the lock for one pass over the tree (a few hundred ns per node), so callers
        that poll should not do it more often than they need.
        """
        with self._lock:
            return take_snapshot(self._roots, self.block_size, head_tokens)

    def export_nodes(self) -> list[NodeRecord]:
        """Every node as a `NodeRecord`, most recently used first, parents before children.

        Read-only; walks the whole tree (for saving the cache at shutdown).
        """
        with self._lock:
            found: list[tuple[int, int, RadixNode]] = []
            for root in self._roots.values():
                stack = [(root, 0)]
                while stack:
                    node, depth = stack.pop()
                    for child in node.children.values():
                        found.append((depth, id(child), child))
                        stack.append((child, depth + 1))
            # Access times never grow down a path, so (newest, shallowest) puts parents first.
            found.sort(key=lambda f: (-f[2].last_access, f[0]))
            index = {nid: i for i, (_, nid, _) in enumerate(found)}
            return [
                NodeRecord(
                    index.get(id(node.parent), -1),
                    node.namespace,
                    decode(node.tokens),
                    list(node.blocks),
                    node.offloaded,
                    node.last_access,
                    node.priority,
                )  # fmt: skip
                for _, _, node in found
            ]

    def restore_nodes(self, records: Sequence[NodeRecord]) -> list[RadixNode | None]:
        """Rebuild an exported tree (`export_nodes` order) into this cache, evicting nothing.

        Records go into the pool while it has room, then into the tier (if any); a record
        whose parent was not restored is skipped. Returns each record's new node or None;
        the caller fills the nodes' blocks with the saved K/V before serving.
        """
        nodes: list[RadixNode | None] = []
        into_tier = False
        with self._lock:
            for rec in records:
                parent = nodes[rec.parent] if rec.parent >= 0 else None
                node = None
                if rec.parent < 0 or parent is not None:
                    if not into_tier:
                        node = self.restore_node(parent, rec, offloaded=False)
                        into_tier = node is None
                    if node is None and self.tier is not None:
                        node = self.restore_node(parent, rec, offloaded=True)
                nodes.append(node)
        return nodes

    def restore_node(
        self,
        parent: RadixNode | None,
        record: NodeRecord,
        offloaded: bool,
    ) -> RadixNode | None:
        """Add `record`'s run under `parent` (None: its namespace's root) with fresh blocks
        of the pool, or of the tier if `offloaded`, evicting nothing.

        Returns the new node, whose `blocks` the caller fills with the saved K/V, or None
        if those blocks are not free or the run is already cached. Keeps the record's
        access time and priority. Side effect: listeners get an "insert" event.
        """
        bs = self.block_size
        n, rem = divmod(len(record.token_ids), bs)
        if n == 0 or rem:
            raise ValueError("a restored run must be a positive whole number of blocks")
        home = self.tier if offloaded else self.pool
        with self._lock:
            if parent is None:
                parent = self._roots.get(record.namespace)
                if parent is None:
                    parent = self._roots[record.namespace] = RadixNode(
                        b"", [], None, record.namespace
                    )
            if home is None or home.num_free < n or (parent.offloaded and not offloaded):
                return None
            node = RadixNode(
                encode(record.token_ids), home.allocate(n), parent, record.namespace,
                record.last_access, record.priority,
            )  # fmt: skip
            key = node.tokens[: self._block_bytes]
            if parent.removed or key in parent.children:
                home.free(node.blocks)
                return None
            node.offloaded = offloaded
            parent.children[key] = node
            self._num_nodes += 1
            if offloaded:
                self._offloaded_blocks += n
            else:
                self._cached_blocks += n
                ns = record.namespace
                self._ns_cached[ns] = self._ns_cached.get(ns, 0) + n
            self._clock = max(self._clock, record.last_access)
            self._enqueue(node)
            if parent.parent is not None:
                self._enqueue(parent)
            if self._listeners:
                path = decode(node.path_tokens())
                self._emit([CacheEvent("insert", record.namespace, path, n * bs)])
            return node

    def stats(self) -> CacheStats:
        """A consistent snapshot of sizes and counters."""
        with self._lock:
            return CacheStats(
                cached_blocks=self._cached_blocks,
                evictable_blocks=self._cached_blocks - self._locked_blocks,
                locked_blocks=self._locked_blocks,
                num_nodes=self._num_nodes,
                lookups=self._lookups,
                hit_tokens=self._hit_tokens,
                missed_tokens=self._missed_tokens,
                inserts=self._inserts,
                inserted_blocks=self._inserted_blocks,
                evicted_blocks=self._evicted_blocks,
                free_blocks=self.pool.num_free,
                total_blocks=self.pool.num_total,
                refetch_blocks=self._refetch.refetched if self._refetch else 0,
                offloaded_blocks=self._offloaded_blocks,
                offload_total_blocks=self.tier.num_total if self.tier is not None else 0,
                demoted_blocks=self._demoted_blocks,
                promoted_blocks=self._promoted_blocks,
                offload_hit_tokens=self._offload_hit_tokens,
            )

    def check_invariants(self, num_private_blocks: int | None = None) -> None:
        """Raise InvariantError on any broken invariant of DESIGN.md.

        With `num_private_blocks` (blocks held by running requests outside the tree),
        also check free + cached + private == total. Walks the whole tree: tests only.
        """
        with self._lock:
            check_tree(
                roots=list(self._roots.values()),
                heap_nodes=[n for q in self._queues.values() for n in q.nodes()],
                pool=self.pool,
                block_size=self.block_size,
                counters={
                    "cached_blocks": self._cached_blocks,
                    "locked_blocks": self._locked_blocks,
                    "num_nodes": self._num_nodes,
                    "offloaded_blocks": self._offloaded_blocks,
                },
                num_private_blocks=num_private_blocks,
                tier=self.tier,
                tier_heap_nodes=self._tier_queue.nodes(),
            )
            self._check_namespace_counts()

    # ----------------------------------------------------------------- internals

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split `node` after its first `k` blocks; return the new upper node.

        `node` keeps its identity as the lower half, so handles to it (locks) stay valid;
        the upper half inherits its lock count, access time and priority.
        """
        bb = self._block_bytes
        parent = node.parent
        assert parent is not None and 0 < k < len(node.blocks)
        upper = RadixNode(
            node.tokens[: k * bb], node.blocks[:k], parent, node.namespace,
            node.last_access, node.priority,
        )  # fmt: skip
        upper.lock_ref = node.lock_ref
        upper.hit_count, upper.access_time = node.hit_count, node.access_time
        upper.score, upper.protected, upper.warm_until = node.score, node.protected, node.warm_until
        upper.offloaded = node.offloaded
        parent.children[node.tokens[:bb]] = upper
        node.tokens = node.tokens[k * bb :]
        node.blocks = node.blocks[k:]
        node.parent = upper
        upper.children[node.tokens[:bb]] = node
        self._num_nodes += 1
        self._policy.on_split(upper, node)
        return upper

    def _trim(self, node: RadixNode, n: int, freed: list[int], events: list[CacheEvent]) -> None:
        """Drop the last `n` blocks of unlocked leaf `node` (it keeps at least one)."""
        self._note_eviction(node, n, events)
        self._drop_blocks(node, node.blocks[-n:], freed)
        del node.blocks[-n:]
        node.tokens = node.tokens[: len(node.tokens) - n * self._block_bytes]
        self._policy.on_drop(node, n)

    def _detach(self, node: RadixNode, freed: list[int], events: list[CacheEvent]) -> None:
        """Remove unlocked leaf `node` from the tree; queue its parent if now evictable."""
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        num = len(node.blocks)
        self._note_eviction(node, num, events)
        del parent.children[node.tokens[: self._block_bytes]]
        self._dequeue(node)
        self._drop_blocks(node, node.blocks, freed)
        self._num_nodes -= 1
        node.blocks = []
        node.parent = None
        node.removed = True
        self._policy.on_drop(node, num)
        if parent.parent is not None:
            if not parent.children or self.tier is not None:
                self._enqueue(parent)
        elif (
            not parent.children
            and parent.namespace is not None
            and self._roots.get(parent.namespace) is parent
        ):
            del self._roots[parent.namespace]  # forget empty namespaces
            self._ns_cached.pop(parent.namespace, None)
            self._ns_locked.pop(parent.namespace, None)
            self._queues.pop(parent.namespace, None)

    def _note_eviction(self, node: RadixNode, n: int, events: list[CacheEvent]) -> None:
        """Tell listeners and the refetch tracker that `node`'s last `n` blocks go."""
        if not self._listeners and self._refetch is None:
            return
        path = node.path_tokens()
        if self._listeners:
            events.append(CacheEvent("evict", node.namespace, decode(path), n * self.block_size))
        if self._refetch is not None:
            total = len(path) // self._block_bytes
            self._refetch.evicted(node.namespace, path, total - n, self._block_bytes)

    def _queue_of(self, node: RadixNode) -> EvictionQueue:
        """The eviction queue `node` belongs in (its namespace's, with a quota)."""
        ns = node.namespace if self._quota_blocks is not None else None
        queue = self._queues.get(ns)
        if queue is None:
            queue = self._queues[ns] = EvictionQueue(self._policy)
        return queue

    def _next_victim(self) -> tuple[RadixNode | None, int]:
        """Pop the leaf to evict next and, when its namespace is over its quota, by how many
        blocks it is over (else 0): from the most-over namespace, else the smallest key."""
        quota = self._quota_blocks
        if quota is not None:
            over = []
            for ns, cached in self._ns_cached.items():
                excess = cached - self._ns_locked.get(ns, 0) - quota
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

    def _check_namespace_counts(self) -> None:
        for ns, root in self._roots.items():
            cached = locked = 0
            for node in post_order(root):
                if node is not root and not node.offloaded:
                    cached += len(node.blocks)
                    locked += len(node.blocks) if node.lock_ref else 0
            if self._ns_cached.get(ns, 0) != cached or self._ns_locked.get(ns, 0) != locked:
                raise InvariantError(
                    f"namespace {ns!r}: counted {self._ns_cached.get(ns, 0)} cached / "
                    f"{self._ns_locked.get(ns, 0)} locked blocks, tree has {cached} / {locked}"
                )

    def _drop_blocks(self, node: RadixNode, blocks: list[int], freed: list[int]) -> None:
        """Account for `blocks` of `node` leaving the cache: pool blocks go to `freed` (the
        caller releases them), tier blocks go back to the tier now."""
        if node.offloaded:
            assert self.tier is not None
            self.tier.free(blocks)
            self._offloaded_blocks -= len(blocks)
            self._evicted_blocks += len(blocks)
        else:
            freed += blocks
            self._cached_blocks -= len(blocks)
            self._ns_cached[node.namespace] -= len(blocks)

    def _enqueue(self, node: RadixNode) -> None:
        """Queue `node` for eviction from its tier if it is evictable there now."""
        if node.offloaded:
            if is_droppable(node):
                self._tier_queue.push(node)
        elif is_evictable(node):
            self._queue_of(node).push(node)

    def _dequeue(self, node: RadixNode) -> None:
        """Drop `node`'s live entry, from whichever queue (pool or tier) holds it."""
        entry = node.in_heap
        if entry is not None:
            entry[3].discard(node)

    def _requeue(self, node: RadixNode) -> None:
        """Re-read the key of `node` (it shrank) in whichever queue holds it."""
        entry = node.in_heap
        if entry is not None:
            entry[3].requeue(node)

    # ----------------------------------------------------------------- offload tier

    def _demote(self, num_blocks: int) -> int:
        """Free up to `num_blocks` pool blocks by moving unlocked pool leaves to the tier.

        A leaf with more blocks than needed is split and only its tail moves. A node the
        tier cannot take (too big, or the tier is all locked) is dropped with its offloaded
        subtree. Returns the pool blocks freed.
        """
        assert self.tier is not None and self._mover is not None
        freed: list[int] = []
        events: list[CacheEvent] = []
        moved = 0
        while moved + len(freed) < num_blocks:
            node, over = self._next_victim()
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
            self._demoted_blocks += n
            self._cached_blocks -= n
            self._ns_cached[node.namespace] -= n
            self._offloaded_blocks += n
            self._dequeue(node)  # making room may have queued it again
            node.blocks = tier_blocks
            node.offloaded = True
            self._enqueue(node)
            assert node.parent is not None
            self._enqueue(node.parent)
        return self._release(freed, events) + moved

    def _tier_allocate(self, n: int, events: list[CacheEvent]) -> list[int] | None:
        """`n` tier blocks, dropping unlocked offloaded leaves by policy to make room;
        None, dropping nothing more, once no leaf is left to drop."""
        tier = self.tier
        assert tier is not None
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
        assert self.tier is not None and self._mover is not None
        chain = _path_to(deep)
        promoted = 0
        self.lock(deep)
        try:
            for node in chain:
                if not node.offloaded:
                    continue
                room = self.pool.num_free + self._cached_blocks - self._locked_blocks
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
        self._promoted_blocks += promoted
        path = _path_to(deep)
        k = 0
        while k < len(path) and not path[k].offloaded:
            k += 1
        return path[:k], promoted

    def _adopt(self, path: list[RadixNode], blocks: Sequence[int]) -> None:
        """Offloaded nodes on an inserted path take the caller's pool blocks for their
        tokens (the caller computed the same K/V), and their tier copies are freed."""
        i = 0
        for node in path:
            n = len(node.blocks)
            if node.offloaded:
                self._take_pool_blocks(node, list(blocks[i : i + n]))
            i += n

    def _take_pool_blocks(self, node: RadixNode, pool_blocks: list[int]) -> None:
        """Make offloaded `node` a pool node holding `pool_blocks`; free its tier blocks."""
        assert self.tier is not None
        self.tier.free(node.blocks)
        self._tier_queue.discard(node)
        n = len(pool_blocks)
        node.blocks = pool_blocks
        node.offloaded = False
        self._offloaded_blocks -= n
        self._cached_blocks += n
        ns = node.namespace
        self._ns_cached[ns] = self._ns_cached.get(ns, 0) + n
        if node.lock_ref:
            self._locked_blocks += n
            self._ns_locked[ns] = self._ns_locked.get(ns, 0) + n

    def _release(self, freed: list[int], events: list[CacheEvent]) -> int:
        """Return evicted blocks to the pool, count them and tell the listeners."""
        self.pool.free(freed)
        self._evicted_blocks += len(freed)
        self._emit(events)
        return len(freed)

    def _emit(self, events: list[CacheEvent]) -> None:
        for event in events:
            for listener in list(self._listeners):
                try:
                    listener(event)
                except Exception:
                    logger.exception("cache listener %r failed on %s", listener, event.kind)


def _path_to(node: RadixNode) -> list[RadixNode]:
    """The nodes from below the root down to `node`."""
    path: list[RadixNode] = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path
