"""The radix prefix cache: token-id prefixes -> KV blocks, at block granularity."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

from radixserve.cache.base import PrefixCache
from radixserve.cache.errors import CacheFullError
from radixserve.cache.eviction import EvictionPolicy, LRUPolicy, dequeue, is_evictable
from radixserve.cache.invariants import check_tree
from radixserve.cache.namespaces import NamespaceQueues
from radixserve.cache.node import RadixNode
from radixserve.cache.pool import BlockPool
from radixserve.cache.refetch import RefetchTracker
from radixserve.cache.snapshot import TreeSnapshot, export_records, take_snapshot
from radixserve.cache.tokens import TOKEN_BYTES, LazyQuery, TokenIds, decode, encode
from radixserve.cache.trie import continuation, path_blocks, post_order, walk
from radixserve.cache.types import CacheEvent, InsertResult, MatchResult, NodeRecord


class RadixCache(PrefixCache):
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

    `TieredRadixCache` (tiered.py) adds an offload tier: it overrides `evict`, `stats`,
    `check_invariants`, `_detach` and the hooks at the end of this class. A node whose
    blocks live in the tier is `offloaded`, and its blocks are not counted as the pool's.
    """

    enabled = True

    def __init__(
        self,
        pool: BlockPool,
        block_size: int = 16,
        policy: EvictionPolicy | None = None,
        *,
        namespace_quota: float | None = None,
        refetch_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(pool, block_size)
        if namespace_quota is not None and not 0.0 < namespace_quota <= 1.0:
            raise ValueError(f"namespace_quota must be in (0, 1], got {namespace_quota}")
        self._block_bytes = block_size * TOKEN_BYTES
        self._policy = policy or LRUPolicy()
        self._policy.bind(pool.num_total)
        quota = None if namespace_quota is None else int(namespace_quota * pool.num_total)
        self._queues = NamespaceQueues(self._policy, quota)
        self._refetch = (
            RefetchTracker(refetch_window_s, clock, 8 * pool.num_total)
            if refetch_window_s > 0
            else None
        )
        self._roots: dict[Hashable, RadixNode] = {None: RadixNode(b"", [], None, None)}
        self._tick = 0  # logical time: one tick per lookup or insert

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy ordering unlocked leaves."""
        return self._policy

    @property
    def namespace_quota_blocks(self) -> int | None:
        """Unlocked blocks one namespace may keep at others' expense (None: no quota)."""
        return self._queues.quota_blocks

    # ----------------------------------------------------------------- lookups

    def match_prefix(
        self, token_ids: TokenIds, namespace: Hashable = None, count: bool = True
    ) -> MatchResult:
        """Find the longest cached prefix of `token_ids` made of whole blocks.

        Side effects: if the match ends inside a node, that node is split at the block
        boundary (the returned node is the new upper half); every node on the matched
        path gets a new last-access time. With `count` (not for the engine's own reads,
        as a K/V handoff's), the hit/miss counters grow, and the nodes of the returned
        match get one more hit and the policy hears of it. Lock the returned node before
        the blocks may be evicted (before the next `evict` or `allocate`).
        """
        with self._mutex:
            counters = self.counters
            root = self._root(namespace)
            if count:
                counters.lookups += 1
            if root is None:
                if count:
                    counters.missed_tokens += len(token_ids)
                return MatchResult(0, [], RadixNode(b"", [], None, namespace))
            path, matched_bytes = self._split_walk(*self._walk(root, token_ids))
            self._tick += 1
            tick = self._tick
            for node in path:
                node.last_access = tick
            path, matched_bytes = self._bring_into_pool(path, matched_bytes)
            now = time.monotonic()
            for node in path:
                node.access_time = now
            blocks = path_blocks(path)
            num_tokens = matched_bytes // TOKEN_BYTES
            if count:
                for node in path:
                    node.hit_count += 1
                if path:
                    self._policy.on_hit(path, tick)
                counters.hit_tokens += num_tokens
                counters.missed_tokens += len(token_ids) - num_tokens
            return MatchResult(num_tokens, blocks, path[-1] if path else root)

    def peek_prefix(self, token_ids: TokenIds, namespace: Hashable = None) -> int:
        """How many leading tokens of `token_ids` are cached (whole blocks).

        Read-only: no split, no access-time update, no statistics.
        """
        with self._mutex:
            root = self._root(namespace)
            if root is None:
                return 0
            _, matched_bytes, _, k = self._walk(root, token_ids)
            return matched_bytes // TOKEN_BYTES + k * self.block_size

    def continuation(
        self, token_ids: TokenIds, namespace: Hashable = None, max_tokens: int = 8
    ) -> list[int]:
        """Up to `max_tokens` token ids that follow `token_ids` along a cached path (the most
        recently used branch where it forks), or [] when `token_ids` is not on one.

        Read-only, like `peek_prefix`: the speculative drafter asks this every decode step.
        """
        with self._mutex:
            root = self._root(namespace)
            if root is None:
                return []
            return continuation(root, self._block_bytes, token_ids, max_tokens)

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
        with self._mutex:
            counters = self.counters
            root = self._root_or_new(namespace)
            query = LazyQuery(token_ids, len(token_ids))
            path, matched_bytes = self._split_walk(*walk(root, self._block_bytes, query))
            num_cached = matched_bytes // self._block_bytes
            self._adopt(path, blocks)
            tree_blocks = path_blocks(path)
            mine = blocks[: len(tree_blocks)]
            duplicates = [b for b, t in zip(mine, tree_blocks, strict=True) if b != t]
            self._tick += 1
            tick = self._tick
            events: list[CacheEvent] = []
            leaf: RadixNode | None = None
            reused = False
            if num_cached < len(blocks):
                data = query.ensure(query.limit_bytes)
                parent = path[-1] if path else root
                leaf = RadixNode(data[matched_bytes:], list(blocks[num_cached:]), parent, namespace)
                parent.children[data[matched_bytes : matched_bytes + self._block_bytes]] = leaf
                path.append(leaf)
                n = len(leaf.blocks)
                counters.num_nodes += 1
                counters.cached_blocks += n
                counters.inserted_blocks += n
                self._queues.add_cached(namespace, n)
                if self._refetch is not None:
                    refetched = self._refetch.inserted(
                        namespace, data, num_cached, len(data), self._block_bytes
                    )
                    counters.refetch_blocks += refetched
                    reused = refetched > 0
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
                self._enqueue(path[-1])
            counters.inserts += 1
            self._emit(events)
            return InsertResult(num_cached * bs, path[-1] if path else root, duplicates)

    def lock(self, node: RadixNode) -> None:
        """Pin the path root..`node`: none of it is evicted until a matching `unlock`.

        Locks nest (a count per node). Locking a root is a no-op. Raises ValueError if
        the node was evicted.
        """
        with self._mutex:
            if node.removed:
                raise ValueError("cannot lock a node that was evicted")
            counters = self.counters
            while node.parent is not None:
                if node.lock_ref == 0 and not node.offloaded:
                    counters.locked_blocks += len(node.blocks)
                    self._queues.add_locked(node.namespace, len(node.blocks))
                node.lock_ref += 1
                node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`; unpinned leaves become evictable.

        Raises ValueError if `node` is not locked (the count would go below zero).
        """
        with self._mutex:
            if node.parent is not None and node.lock_ref <= 0:
                raise ValueError("unlock of a node that is not locked")
            counters = self.counters
            while node.parent is not None:
                node.lock_ref -= 1
                if node.lock_ref == 0:
                    if not node.offloaded:
                        counters.locked_blocks -= len(node.blocks)
                        self._queues.add_locked(node.namespace, -len(node.blocks))
                    self._enqueue(node)
                node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks from unlocked leaves, in eviction-policy order.

        Returns how many were freed (fewer only if fewer are evictable). With a namespace
        quota, namespaces over it give their blocks first. A leaf with more blocks than
        still needed loses only its tail blocks. A parent left as an unlocked leaf may be
        evicted in the same call. Freed blocks go back to the pool; listeners get one
        "evict" event per removed run.
        """
        with self._mutex:
            self._requeue_fallen()
            freed: list[int] = []
            events: list[CacheEvent] = []
            while len(freed) < num_blocks:
                need = num_blocks - len(freed)
                victim, over = self._queues.pop_victim()
                if victim is None:
                    break
                if over:
                    need = min(need, over)
                if len(victim.blocks) > need:
                    self._trim(victim, need, freed, events)
                    self._queues.push(victim)
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
        with self._mutex:
            root = self._root(namespace)
            if root is None:
                return 0
            query = LazyQuery(token_ids, len(token_ids))
            path, matched_bytes, child, k = walk(root, self._block_bytes, query)
            if child is None:
                if matched_bytes < num_bytes:
                    return 0
                child, k = path[-1], len(path[-1].blocks)
            elif matched_bytes + k * self._block_bytes < num_bytes:
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

    def reset(self) -> int:
        """Remove every unlocked node of every namespace, from the pool and the tier (a node
        a request locks stays, and so do its ancestors); returns the pool blocks freed.

        The dropped blocks count as evicted but not as refetch candidates (nothing thrashed).
        Plain listeners get one "evict" per removed run; detailed ones one "clear", then an
        "insert" per node that stayed, parents first.
        """
        with self._mutex:
            refetch, self._refetch = self._refetch, None
            freed: list[int] = []
            events: list[CacheEvent] = []
            try:
                for root in list(self._roots.values()):
                    for node in post_order(root):
                        if node is not root and node.lock_ref == 0:
                            self._detach(node, freed, events)
            finally:
                self._refetch = refetch
            detailed: list[CacheEvent] | None = None
            if self._detail_wanted:
                detailed = [CacheEvent("clear", None, (), 0)]
                for root in self._roots.values():
                    for node in reversed(post_order(root)):
                        if node is not root:
                            path = decode(node.path_tokens())
                            detailed.append(
                                CacheEvent(
                                    "insert", node.namespace, path, node.num_tokens, node.offloaded
                                )
                            )
            return self._release(freed, events, detailed)

    def allocate(self, num_blocks: int) -> list[int]:
        """Allocate blocks from the pool, evicting first if the pool is short.

        Raises CacheFullError, evicting nothing, if free plus evictable blocks are too few.
        """
        with self._mutex:
            short = num_blocks - self.pool.num_free
            if short > 0:
                evictable = self.counters.cached_blocks - self.counters.locked_blocks
                if short > evictable:
                    raise CacheFullError(num_blocks, self.pool.num_free + evictable)
                self.evict(short)
            return self.pool.allocate(num_blocks)

    # ----------------------------------------------------------------- observers

    def leaf_paths(self) -> list[tuple[Hashable, tuple[int, ...]]]:
        """(namespace, token ids from the root) of every leaf: a snapshot of what is cached.

        Walks the whole tree under the lock; for snapshots and tests, not the hot path.
        """
        out: list[tuple[Hashable, tuple[int, ...]]] = []
        with self._mutex:
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
        with self._mutex:
            return take_snapshot(self._roots, self.block_size, head_tokens)

    def export_nodes(self) -> list[NodeRecord]:
        """Every node as a `NodeRecord`, most recently used first, parents before children.

        Read-only; walks the whole tree (for saving the cache at shutdown).
        """
        with self._mutex:
            return export_records(self._roots.values())

    def restore_nodes(self, records: Sequence[NodeRecord]) -> list[RadixNode | None]:
        """Rebuild an exported tree (`export_nodes` order) into this cache, evicting nothing.

        Records go into the pool while it has room (a tiered cache puts the rest into its
        tier); a record whose parent was not restored is skipped. Returns each record's new
        node or None; the caller fills the nodes' blocks with the saved K/V before serving.
        Keeps each record's access time and priority. Side effect: listeners get an
        "insert" event per restored node.
        """
        nodes: list[RadixNode | None] = []
        pool_full = False
        with self._mutex:
            for rec in records:
                parent = nodes[rec.parent] if rec.parent >= 0 else None
                node = None
                if rec.parent < 0 or parent is not None:
                    if not pool_full:
                        node = self._restore_node(parent, rec)
                        pool_full = node is None
                    if node is None:
                        node = self._restore_elsewhere(parent, rec)
                nodes.append(node)
        return nodes

    def check_invariants(self, num_private_blocks: int | None = None) -> None:
        """Raise InvariantError on any broken invariant (docs/architecture.md, "Invariants").

        With `num_private_blocks` (blocks held by running requests outside the tree),
        also check free + cached + private == total. Walks the whole tree: tests only.
        """
        self._check(num_private_blocks)

    # ----------------------------------------------------------------- internals

    def _root(self, namespace: Hashable) -> RadixNode | None:
        """`namespace`'s root; None where it has none."""
        return self._roots.get(namespace)

    def _root_or_new(self, namespace: Hashable) -> RadixNode:
        """`namespace`'s root, made where it has none."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode(b"", [], None, namespace)
        return root

    def _split_walk(
        self, path: list[RadixNode], matched_bytes: int, child: RadixNode | None, k: int
    ) -> tuple[list[RadixNode], int]:
        """A walk's (path, matched bytes) once the node it ends inside (`child`, `k` blocks
        in) is split at that block boundary, its upper half appended to the path."""
        if child is not None:
            path.append(self._split(child, k))
            matched_bytes += k * self._block_bytes
        return path, matched_bytes

    def _walk(
        self, root: RadixNode, token_ids: TokenIds
    ) -> tuple[list[RadixNode], int, RadixNode | None, int]:
        """`walk` for the longest whole-block prefix of `token_ids` that is a hit: with
        sliding-window layers in their own pool (`pool.window`), one whose last window of
        tokens still has its window slots."""
        query = LazyQuery(token_ids, len(token_ids) // self.block_size * self.block_size)
        path, matched_bytes, child, k = walk(root, self._block_bytes, query)
        window = self.pool.window
        if window is None or not (path or k):
            return path, matched_bytes, child, k
        total = matched_bytes // TOKEN_BYTES + k * self.block_size
        blocks = path_blocks(path) + (child.blocks[:k] if child is not None else [])
        usable = window.usable(blocks, total)
        if usable == total:
            return path, matched_bytes, child, k
        return walk(root, self._block_bytes, LazyQuery(token_ids, usable))

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Split `node` after its first `k` blocks; return the new upper node.

        `node` keeps its identity as the lower half, so handles to it (locks) stay valid;
        the upper half inherits its lock count, access time, priority and tier.
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
        self.counters.num_nodes += 1
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
        dequeue(node)
        self._drop_blocks(node, node.blocks, freed)
        self.counters.num_nodes -= 1
        node.blocks = []
        node.parent = None
        node.removed = True
        self._policy.on_drop(node, num)
        if parent.parent is not None:
            if not parent.children:
                self._enqueue(parent)
        elif (
            not parent.children
            and parent.namespace is not None
            and self._roots.get(parent.namespace) is parent
        ):
            del self._roots[parent.namespace]  # forget empty namespaces
            self._queues.forget(parent.namespace)

    def _note_eviction(self, node: RadixNode, n: int, events: list[CacheEvent]) -> None:
        """Tell listeners and the refetch tracker that `node`'s last `n` blocks go."""
        if not self._listeners and self._refetch is None:
            return
        path = node.path_tokens()
        if self._listeners:
            events.append(
                CacheEvent(
                    "evict", node.namespace, decode(path), n * self.block_size, node.offloaded
                )
            )
        if self._refetch is not None:
            total = len(path) // self._block_bytes
            self._refetch.evicted(node.namespace, path, total - n, self._block_bytes)

    def _requeue_fallen(self) -> None:
        """Re-read the keys of the nodes whose keys the policy lowered since last time."""
        for node in self._policy.fallen():
            entry = node.in_heap
            if entry is not None:
                entry[3].requeue(node)

    def _restore_node(self, parent: RadixNode | None, record: NodeRecord) -> RadixNode | None:
        """Restore `record` under `parent` into the pool (see `_attach_record`)."""
        node = self._attach_record(parent, record, self.pool)
        if node is not None:
            self.counters.cached_blocks += len(node.blocks)
            self._queues.add_cached(node.namespace, len(node.blocks))
            self._announce_restored(node)
        return node

    def _attach_record(
        self, parent: RadixNode | None, record: NodeRecord, home: BlockPool
    ) -> RadixNode | None:
        """Add `record`'s run under `parent` (None: its namespace's root) with fresh blocks
        of `home` (the pool, or a tier), evicting nothing; the caller counts the blocks.

        Returns the new node, keeping the record's access time and priority, or None if
        those blocks are not free or the run is already cached.
        """
        n, rem = divmod(len(record.token_ids), self.block_size)
        if n == 0 or rem:
            raise ValueError("a restored run must be a positive whole number of blocks")
        if parent is None:
            parent = self._root_or_new(record.namespace)
        if home.num_free < n:
            return None
        node = RadixNode(
            encode(record.token_ids), home.allocate(n), parent, record.namespace,
            record.last_access, record.priority,
        )  # fmt: skip
        key = node.tokens[: self._block_bytes]
        if parent.removed or key in parent.children:
            home.free(node.blocks)
            return None
        parent.children[key] = node
        self.counters.num_nodes += 1
        self._tick = max(self._tick, record.last_access)
        return node

    def _announce_restored(self, node: RadixNode) -> None:
        """Queue a restored `node` (and its parent) for eviction and tell the listeners."""
        self._enqueue(node)
        parent = node.parent
        assert parent is not None
        if parent.parent is not None:
            self._enqueue(parent)
        if self._listeners:
            path = decode(node.path_tokens())
            event = CacheEvent("insert", node.namespace, path, node.num_tokens, node.offloaded)
            self._emit([event])

    def _release(
        self,
        freed: list[int],
        events: list[CacheEvent],
        detailed: list[CacheEvent] | None = None,
    ) -> int:
        """Return evicted blocks to the pool, count them and tell the listeners (`_emit`'s
        `detailed`: what detailed listeners get instead of `events`)."""
        self.pool.free(freed)
        self.counters.evicted_blocks += len(freed)
        self._emit(events, detailed)
        return len(freed)

    def _check(
        self,
        num_private_blocks: int | None,
        tier: BlockPool | None = None,
        tier_queued: list[RadixNode] | None = None,
    ) -> None:
        """`check_invariants`, with the offload `tier` and its queued nodes if there is one."""
        with self._mutex:
            check_tree(
                roots=list(self._roots.values()),
                heap_nodes=self._queues.nodes(),
                pool=self.pool,
                block_size=self.block_size,
                counters=self.counters,
                num_private_blocks=num_private_blocks,
                tier=tier,
                tier_heap_nodes=tier_queued,
            )
            self._queues.check_counts(self._roots.items())

    # ----------------------------------------------------------------- hooks (tiered.py)

    def _bring_into_pool(
        self, path: list[RadixNode], matched_bytes: int
    ) -> tuple[list[RadixNode], int]:
        """The part of a matched `path` (of `matched_bytes` bytes) a request may use, and its bytes.
        Every node of this tree is in the pool: all of it."""
        return path, matched_bytes

    def _adopt(self, path: list[RadixNode], blocks: Sequence[int]) -> None:
        """Called by `insert` with the already-cached `path` and the caller's `blocks`, before
        it compares them. Every node of this tree is in the pool: nothing to adopt."""
        return None

    def _enqueue(self, node: RadixNode) -> None:
        """Queue `node` for eviction if it is evictable now."""
        if is_evictable(node):
            self._queues.push(node)

    def _drop_blocks(self, node: RadixNode, blocks: list[int], freed: list[int]) -> None:
        """Account for `blocks` of `node` leaving the cache; they go to `freed`, which the
        caller releases to the pool."""
        freed += blocks
        self.counters.cached_blocks -= len(blocks)
        self._queues.add_cached(node.namespace, -len(blocks))

    def _restore_elsewhere(self, parent: RadixNode | None, record: NodeRecord) -> RadixNode | None:
        """Where `restore_nodes` puts a record the pool did not take: nowhere (None)."""
        return None
