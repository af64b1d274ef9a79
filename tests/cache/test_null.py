"""NullCache, the cache turned off, and make_prefix_cache, which picks the cache to build."""

from __future__ import annotations

import pytest

from radixserve.cache import (
    BlockPool,
    CacheFullError,
    InvariantError,
    NodeRecord,
    NullCache,
    PrefixCache,
    RadixCache,
    SessionRetention,
    TieredRadixCache,
    make_prefix_cache,
)

from .helpers import BS, Recorder, seq


class NoMover:
    """A `BlockMover` for caches whose blocks hold no bytes."""

    def demote(self, pool_blocks: list[int], tier_blocks: list[int]) -> None:
        pass

    def promote(self, tier_blocks: list[int], pool_blocks: list[int]) -> None:
        pass


def test_null_cache_finds_nothing_and_counts_the_lookup_as_missed() -> None:
    cache = NullCache(BlockPool(8), BS)
    m = cache.match_prefix(seq((1, 8)), "ns")
    assert (m.num_tokens, m.blocks, m.node.namespace) == (0, [], "ns")
    assert cache.peek_prefix(seq((1, 8))) == 0
    s = cache.stats()
    assert (s.lookups, s.hit_tokens, s.missed_tokens) == (1, 0, 8)


def test_null_cache_insert_takes_no_block_and_caches_nothing() -> None:
    cache = NullCache(BlockPool(8), BS)
    events = Recorder()
    cache.add_listener(events)
    blocks = cache.allocate(2)
    res = cache.insert(seq((1, 8)), blocks)
    assert (res.num_cached_tokens, res.duplicate_blocks, res.node.blocks) == (0, [], [])
    assert res.node.parent is None  # a root: the path the cache keeps holds no block
    cache.lock(res.node)
    cache.unlock(res.node)
    assert cache.peek_prefix(seq((1, 8))) == 0
    assert cache.leaf_paths() == [] and cache.export_nodes() == []
    assert cache.snapshot().num_nodes == 0
    assert events.events == []
    assert cache.pool.num_used == 2  # still the caller's
    cache.check_invariants(num_private_blocks=2)


def test_null_cache_insert_refuses_what_the_radix_cache_refuses() -> None:
    cache = NullCache(BlockPool(8), BS)
    with pytest.raises(ValueError):
        cache.insert(seq((1, 8)), cache.allocate(1))
    with pytest.raises(ValueError):
        cache.insert(seq((1, 4)), [7])  # a free block


def test_null_cache_allocates_straight_from_the_pool_and_never_evicts() -> None:
    cache = NullCache(BlockPool(4), BS)
    held = cache.allocate(3)
    assert cache.evict(10) == 0 and cache.evict_path(seq((1, 4))) == 0
    with pytest.raises(CacheFullError):
        cache.allocate(2)
    assert cache.pool.num_free == 1
    cache.pool.free(held)
    assert cache.stats().free_blocks == 4 and cache.stats().evicted_blocks == 0


def test_null_cache_restores_nothing() -> None:
    cache = NullCache(BlockPool(8), BS)
    record = NodeRecord(-1, None, tuple(seq((1, 4))), [0], False, 1, 0)
    assert cache.restore_nodes([record, record]) == [None, None]
    assert cache.pool.num_free == 8


def test_null_cache_check_invariants_detects_a_wrong_private_count() -> None:
    cache = NullCache(BlockPool(8), BS)
    cache.allocate(3)
    with pytest.raises(InvariantError, match="private"):
        cache.check_invariants(num_private_blocks=2)
    cache.check_invariants()


def test_make_prefix_cache_builds_the_cache_the_settings_ask_for() -> None:
    def make(enabled: bool, tier_blocks: int = 0) -> PrefixCache:
        return make_prefix_cache(
            num_blocks=32,
            block_size=BS,
            enabled=enabled,
            eviction_policy="slru",
            session_ttl=5.0,
            namespace_quota=0.5,
            refetch_window=60.0,
            tier_blocks=tier_blocks,
            mover=NoMover() if tier_blocks else None,
        )

    off, on, tiered = make(False), make(True), make(True, tier_blocks=8)
    assert type(off) is NullCache and not off.enabled
    assert type(on) is RadixCache and on.enabled and on.namespace_quota_blocks == 16
    assert type(tiered) is TieredRadixCache and tiered.stats().offload_total_blocks == 8
    for cache in (off, on, tiered):
        assert cache.pool.num_total == 32 and cache.block_size == BS
        assert isinstance(cache.policy, SessionRetention) and cache.policy.name == "slru"


@pytest.mark.parametrize("enabled", [False, True])
def test_make_prefix_cache_refuses_bad_settings_with_the_cache_on_or_off(enabled: bool) -> None:
    settings: dict[str, object] = dict(
        num_blocks=8,
        block_size=BS,
        enabled=enabled,
        eviction_policy="lru",
        session_ttl=0.0,
        namespace_quota=None,
        refetch_window=60.0,
        tier_blocks=0,
        mover=None,
    )
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_prefix_cache(**{**settings, "eviction_policy": "nope"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mover"):
        make_prefix_cache(**{**settings, "tier_blocks": 4})  # type: ignore[arg-type]
