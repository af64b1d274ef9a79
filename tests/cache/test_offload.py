"""The offload tier: demotion instead of eviction, promotion on match, export and restore.

A `PayloadMover` stands in for the model-side byte mover: each block holds a label (the
namespace and token prefix whose K/V it would hold), and the mover copies labels between
the pool's and the tier's arrays. Checking labels after every step shows that the bytes
follow the blocks through demote, promote, drop and restart.
"""

from __future__ import annotations

from collections.abc import Hashable

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache import (
    BlockPool,
    CacheFullError,
    EvictionPolicy,
    PriorityLRUPolicy,
    RadixCache,
    RadixNode,
    SLRUPolicy,
    TieredRadixCache,
    make_policy,
)
from radixserve.cache.trie import post_order
from radixserve.cache.types import NodeRecord

from .helpers import Recorder

Label = tuple[Hashable, tuple[int, ...]] | None


class PayloadMover:
    """Copies block labels between a pool array and a tier array (a fake KV store)."""

    def __init__(self, pool_blocks: int, tier_blocks: int) -> None:
        self.pool: list[Label] = [None] * pool_blocks
        self.tier: list[Label] = [None] * tier_blocks
        self.demotes = 0
        self.promotes = 0

    def demote(self, pool_blocks: list[int], tier_blocks: list[int]) -> None:
        self.demotes += 1
        for p, t in zip(pool_blocks, tier_blocks, strict=True):
            self.tier[t] = self.pool[p]

    def promote(self, tier_blocks: list[int], pool_blocks: list[int]) -> None:
        self.promotes += 1
        for t, p in zip(tier_blocks, pool_blocks, strict=True):
            self.pool[p] = self.tier[t]


def tiered(
    pool_blocks: int,
    tier_blocks: int,
    bs: int,
    policy: EvictionPolicy | None = None,
    namespace_quota: float | None = None,
) -> tuple[RadixCache, PayloadMover]:
    mover = PayloadMover(pool_blocks, tier_blocks)
    cache = TieredRadixCache(
        BlockPool(pool_blocks),
        bs,
        policy,
        tier=BlockPool(tier_blocks),
        mover=mover,
        namespace_quota=namespace_quota,
    )
    return cache, mover


def compute(
    cache: RadixCache,
    mover: PayloadMover,
    tokens: list[int],
    namespace: Hashable = None,
    priority: int = 0,
    session: bool = False,
) -> list[int]:
    """Serve `tokens` as the engine does: match (promoting), compute the rest, insert.

    Returns the block ids the request used; raises CacheFullError if the pool is short.
    """
    bs = cache.block_size
    m = cache.match_prefix(tokens, namespace)
    cache.lock(m.node)
    try:
        fresh = cache.allocate(len(tokens) // bs - len(m.blocks))
    finally:
        cache.unlock(m.node)
    blocks = m.blocks + fresh
    for i, b in enumerate(fresh, start=len(m.blocks)):
        mover.pool[b] = (namespace, tuple(tokens[: (i + 1) * bs]))
    res = cache.insert(tokens, blocks, namespace, priority, session)
    cache.pool.free(res.duplicate_blocks)
    return blocks


def check_labels(cache: RadixCache, mover: PayloadMover) -> None:
    """Every cached block holds the K/V label of its own path prefix."""
    for rec, path in zip(cache.export_nodes(), _paths(cache.export_nodes()), strict=True):
        store = mover.tier if rec.offloaded else mover.pool
        start = len(path) - len(rec.token_ids)
        for i, b in enumerate(rec.blocks):
            end = start + (i + 1) * cache.block_size
            assert store[b] == (rec.namespace, path[:end]), f"block {b} of {rec} holds stale K/V"


def _paths(records: list[NodeRecord]) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for rec in records:
        paths.append((paths[rec.parent] if rec.parent >= 0 else ()) + rec.token_ids)
    return paths


def test_eviction_demotes_and_match_promotes_the_same_kv() -> None:
    cache, mover = tiered(4, 8, 2)
    events = Recorder()
    cache.add_listener(events)
    compute(cache, mover, [1, 1, 2, 2, 3, 3])
    compute(cache, mover, [5, 5, 6, 6])  # pool full: [1,1,2,2] is demoted to make room
    s = cache.stats()
    assert s.offloaded_blocks > 0 and s.evicted_blocks == 0
    assert [e.kind for e in events.events] == ["insert", "insert"]  # demotion: no event
    m = cache.match_prefix([1, 1, 2, 2, 3, 3, 9])
    assert m.num_tokens == 6
    assert [mover.pool[b] for b in m.blocks] == [
        (None, (1, 1)),
        (None, (1, 1, 2, 2)),
        (None, (1, 1, 2, 2, 3, 3)),
    ]
    assert cache.stats().offload_hit_tokens > 0
    check_labels(cache, mover)
    cache.check_invariants(0)


def test_a_node_moving_back_and_forth_is_queued_once() -> None:
    cache, mover = tiered(2, 4, 1)
    compute(cache, mover, [1, 2])
    for _ in range(3):
        compute(cache, mover, [3, 4])  # demotes [1, 2] (promoting [3, 4] after round one)
        cache.check_invariants(0)
        assert cache.match_prefix([1, 2, 0]).num_tokens == 2  # promotes it again
        cache.check_invariants(0)
    check_labels(cache, mover)


def test_peek_sees_offloaded_prefixes_without_moving_them() -> None:
    cache, mover = tiered(2, 8, 2)
    compute(cache, mover, [1, 1, 2, 2])
    compute(cache, mover, [3, 3, 4, 4])
    assert cache.stats().offloaded_blocks == 2
    assert cache.peek_prefix([1, 1, 2, 2, 5]) == 4
    assert mover.promotes == 0


def test_full_tier_drops_its_least_recent_leaf_with_an_evict_event() -> None:
    cache, mover = tiered(2, 2, 2)
    events = Recorder()
    compute(cache, mover, [1, 1, 2, 2])
    compute(cache, mover, [3, 3, 4, 4])  # [1,1,2,2] -> tier
    cache.add_listener(events)
    compute(cache, mover, [5, 5, 6, 6])  # [3,3,4,4] -> tier, [1,1,2,2] dropped
    assert [(e.kind, e.token_ids) for e in events.events] == [
        ("evict", (1, 1, 2, 2)),
        ("insert", (5, 5, 6, 6)),
    ]
    assert cache.peek_prefix([1, 1, 2, 2]) == 0
    assert cache.peek_prefix([3, 3, 4, 4]) == 4
    assert cache.stats().evicted_blocks == 2
    cache.check_invariants(0)


def test_the_tier_drops_by_the_caches_policy() -> None:
    """Both tiers order by one policy: under `priority` the tier drops the newer low-tier
    leaf and keeps the older high-tier one (LRU would do the opposite)."""
    cache, mover = tiered(1, 2, 2, PriorityLRUPolicy())
    compute(cache, mover, [1, 1], priority=1)
    compute(cache, mover, [2, 2])  # demotes [1, 1]
    compute(cache, mover, [3, 3])  # demotes [2, 2]: the tier is full
    compute(cache, mover, [4, 4])  # demotes [3, 3]: the tier drops one leaf
    assert cache.peek_prefix([1, 1]) == 2 and cache.peek_prefix([2, 2]) == 0
    assert cache.stats().offloaded_blocks == 2
    cache.check_invariants(0)
    check_labels(cache, mover)


def test_node_larger_than_the_tier_is_dropped_with_its_subtree() -> None:
    cache, mover = tiered(4, 1, 1)
    compute(cache, mover, [1, 2, 3, 4])
    compute(cache, mover, [7, 8, 9, 6])
    assert cache.peek_prefix([7, 8, 9, 6]) == 4
    assert cache.stats().cached_blocks + cache.stats().offloaded_blocks <= 5
    check_labels(cache, mover)
    cache.check_invariants(0)


def test_partial_promotion_when_the_pool_is_pinned() -> None:
    cache, mover = tiered(4, 8, 1)
    compute(cache, mover, [1, 2, 3, 4])
    held = cache.allocate(4)  # a running request takes the whole pool: all four demoted
    assert cache.stats().offloaded_blocks == 4
    cache.pool.free(held[:2])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.num_tokens == 2 and len(m.blocks) == 2
    assert cache.peek_prefix([1, 2, 3, 4]) == 4  # the rest stays offloaded, still matched
    check_labels(cache, mover)
    cache.check_invariants(num_private_blocks=2)


def test_insert_through_an_offloaded_node_takes_the_callers_blocks() -> None:
    cache, mover = tiered(4, 8, 2)
    compute(cache, mover, [1, 1, 2, 2])
    private = cache.allocate(4)  # demotes [1,1,2,2]
    assert cache.stats().offloaded_blocks == 2
    cache.pool.free(private[2:])
    for i, b in enumerate(private[:2]):
        mover.pool[b] = (None, (1, 1, 2, 2)[: (i + 1) * 2])
    res = cache.insert([1, 1, 2, 2], private[:2])
    assert res.num_cached_tokens == 4 and res.duplicate_blocks == []
    s = cache.stats()
    assert s.offloaded_blocks == 0 and s.cached_blocks == 2
    check_labels(cache, mover)
    cache.check_invariants(0)


def test_export_lists_parents_first_and_restore_rebuilds_the_tree() -> None:
    cache, mover = tiered(4, 8, 2)
    compute(cache, mover, [1, 1, 2, 2])
    compute(cache, mover, [1, 1, 3, 3], namespace="t")
    compute(cache, mover, [1, 1, 2, 2, 4, 4])
    records = cache.export_nodes()
    assert all(rec.parent < i for i, rec in enumerate(records))
    fresh, fresh_mover = tiered(2, 8, 2)
    events = Recorder()
    fresh.add_listener(events)
    restored = restore(records, mover, fresh, fresh_mover)
    assert restored == len(records)
    assert fresh.peek_prefix([1, 1, 2, 2, 4, 4]) == 6
    assert fresh.peek_prefix([1, 1, 3, 3], "t") == 4
    assert sorted(fresh.leaf_paths(), key=repr) == sorted(cache.leaf_paths(), key=repr)
    assert all(e.kind == "insert" for e in events.events)
    check_labels(fresh, fresh_mover)
    fresh.check_invariants(0)


def restore(
    records: list[NodeRecord], old: PayloadMover, cache: RadixCache, mover: PayloadMover
) -> int:
    """Load `records` into `cache` as the engine's loader does, copying the labels."""
    nodes = cache.restore_nodes(records)
    for rec, node in zip(records, nodes, strict=True):
        if node is not None:
            src = old.tier if rec.offloaded else old.pool
            dst = mover.tier if node.offloaded else mover.pool
            for a, b in zip(rec.blocks, node.blocks, strict=True):
                dst[b] = src[a]
    return sum(node is not None for node in nodes)


# ---------------------------------------------------------------- property test

BS = 2
POOL, TIER = 10, 12
tokens_st = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from([[], [0, 0], [0, 0, 1, 1], [1, 2, 1, 2, 0, 0]]),
    st.lists(st.integers(0, 2), max_size=8),
)
namespace_st = st.sampled_from([None, "b"])


class TieredMachine(RuleBasedStateMachine):
    """Random serve/hold/release/evict/restart sequences over a pool and a tier.

    Subclasses run the same sequences under each eviction policy (both tiers use it) and
    with a namespace quota."""

    policy_name = "lru"
    session_ttl = 0.0
    quota: float | None = None

    def __init__(self) -> None:
        super().__init__()
        self.cache, self.mover = self.new_cache(POOL, TIER)
        self.held: list[tuple[RadixNode, list[int]]] = []  # running requests: lock, private

    def new_cache(self, pool: int, tier: int) -> tuple[RadixCache, PayloadMover]:
        policy = make_policy(self.policy_name, self.session_ttl)
        if tier:
            return tiered(pool, tier, BS, policy, self.quota)
        cache = RadixCache(BlockPool(pool), BS, policy, namespace_quota=self.quota)
        return cache, PayloadMover(pool, 0)

    @rule(
        tokens=tokens_st, namespace=namespace_st, priority=st.integers(0, 1), session=st.booleans()
    )
    def serve(self, tokens: list[int], namespace: Hashable, priority: int, session: bool) -> None:
        tokens = tokens[: len(tokens) // BS * BS]
        expect = self.cache.peek_prefix(tokens, namespace)
        try:
            blocks = compute(self.cache, self.mover, tokens, namespace, priority, session)
        except CacheFullError:
            return
        for i, b in enumerate(blocks):
            assert self.mover.pool[b] == (namespace, tuple(tokens[: (i + 1) * BS]))
        assert self.cache.peek_prefix(tokens, namespace) == len(tokens) >= expect

    @rule(tokens=tokens_st, namespace=namespace_st)
    def hold(self, tokens: list[int], namespace: Hashable) -> None:
        """A running request pins its match and keeps one private block."""
        m = self.cache.match_prefix(tokens, namespace)
        self.cache.lock(m.node)
        try:
            private = self.cache.allocate(1)
        except CacheFullError:
            self.cache.unlock(m.node)
            return
        for i, b in enumerate(m.blocks):
            assert self.mover.pool[b] == (namespace, tuple(tokens[: (i + 1) * BS]))
        self.held.append((m.node, private))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        node, private = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.pool.free(private)
        self.cache.unlock(node)

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        before = self.cache.stats()
        freed = self.cache.evict(n)
        assert freed == min(n, before.evictable_blocks)

    @rule(pool=st.integers(2, POOL), tier=st.integers(0, TIER))
    def restart(self, pool: int, tier: int) -> None:
        """Graceful shutdown (requests end), export, and restore into fresh pools."""
        while self.held:
            self.release_one()
        old = self.cache.stats()
        before = sorted(self.cache.leaf_paths(), key=repr)
        records = self.cache.export_nodes()
        cache, mover = self.new_cache(pool, tier)
        restore(records, self.mover, cache, mover)
        if old.cached_blocks + old.offloaded_blocks <= pool:  # everything fits in the pool
            assert sorted(cache.leaf_paths(), key=repr) == before
        self.cache, self.mover = cache, mover

    def release_one(self) -> None:
        node, private = self.held.pop()
        self.cache.pool.free(private)
        self.cache.unlock(node)

    @invariant()
    def every_block_in_one_place(self) -> None:
        private = sum(len(p) for _, p in self.held)
        self.cache.check_invariants(num_private_blocks=private)
        check_labels(self.cache, self.mover)
        policy = self.cache.policy
        if isinstance(policy, SLRUPolicy):  # its segment count follows nodes across tiers
            nodes = [n for root in self.cache._roots.values() for n in post_order(root)]
            assert policy.protected_blocks == sum(len(n.blocks) for n in nodes if n.protected)

    def teardown(self) -> None:
        while self.held:
            self.release_one()
        assert self.cache.stats().locked_blocks == 0


TieredMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiered_cache_keeps_every_block_in_one_place = TieredMachine.TestCase


class FanoutTieredMachine(TieredMachine):
    policy_name = "fanout"


class SLRUTieredMachine(TieredMachine):
    policy_name = "slru"


class PrioritySessionTieredMachine(TieredMachine):
    policy_name = "priority"
    session_ttl = 1e-3  # warmth runs out during a run, so its fallen nodes are re-queued


class QuotaTieredMachine(TieredMachine):
    quota = 0.5


_variant_settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
for _machine in (
    FanoutTieredMachine,
    SLRUTieredMachine,
    PrioritySessionTieredMachine,
    QuotaTieredMachine,
):
    _machine.TestCase.settings = _variant_settings
test_tiered_cache_under_fanout = FanoutTieredMachine.TestCase
test_tiered_cache_under_slru = SLRUTieredMachine.TestCase
test_tiered_cache_under_priority_and_sessions = PrioritySessionTieredMachine.TestCase
test_tiered_cache_with_a_namespace_quota = QuotaTieredMachine.TestCase
