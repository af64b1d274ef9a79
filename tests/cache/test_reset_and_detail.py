"""`reset` and the detailed events (tier moves, a reset as one "clear") of `add_listener`."""

from __future__ import annotations

from radixserve.cache import BlockPool, CacheEvent, TieredRadixCache

from .helpers import BS, Recorder, make_cache, put, seq


class NoBytes:
    """A block mover for caches whose blocks hold no K/V."""

    def demote(self, pool_blocks: list[int], tier_blocks: list[int]) -> None:
        pass

    def promote(self, tier_blocks: list[int], pool_blocks: list[int]) -> None:
        pass


def tiered(pool: int = 4, tier: int = 8) -> TieredRadixCache:
    return TieredRadixCache(BlockPool(pool), BS, None, BlockPool(tier), NoBytes())


def store(cache: TieredRadixCache, tokens: list[int]) -> None:
    """Insert `tokens` into blocks the cache allocates (demoting to make room)."""
    cache.insert(tokens, cache.allocate(len(tokens) // BS))


def test_reset_drops_every_unlocked_node_and_frees_its_blocks() -> None:
    cache = make_cache(16)
    put(cache, seq((1, 8)))
    put(cache, seq((2, 4)), namespace="salt")
    assert cache.reset() == 3
    assert cache.leaf_paths() == []
    assert cache.pool.num_free == 16
    cache.check_invariants(0)


def test_reset_keeps_a_locked_path() -> None:
    cache = make_cache(16)
    kept = put(cache, seq((1, 8)))
    put(cache, seq((1, 8), (3, 4)))
    put(cache, seq((2, 4)))
    cache.lock(kept.node)
    assert cache.reset() == 2
    assert cache.leaf_paths() == [(None, tuple(seq((1, 8))))]
    cache.unlock(kept.node)
    cache.check_invariants(0)


def test_plain_listener_hears_a_reset_as_evictions() -> None:
    cache = make_cache(16)
    put(cache, seq((1, 4), (2, 4)))
    rec = Recorder()
    cache.add_listener(rec)
    cache.reset()
    assert rec.kinds() == [("evict", 8, 8)]


def test_detailed_listener_hears_clear_then_what_stays() -> None:
    cache = make_cache(16)
    kept = put(cache, seq((1, 8)), namespace="s")
    put(cache, seq((2, 4)))
    cache.lock(kept.node)
    rec = Recorder()
    cache.add_listener(rec, detail=True)
    cache.reset()
    assert rec.events == [
        CacheEvent("clear", None, (), 0),
        CacheEvent("insert", "s", tuple(seq((1, 8))), 8),
    ]


def test_detailed_listener_hears_demotion_and_promotion_plain_does_not() -> None:
    cache = tiered(pool=2, tier=8)
    plain, detail = Recorder(), Recorder()
    cache.add_listener(plain)
    cache.add_listener(detail, detail=True)
    store(cache, seq((1, 8)))
    store(cache, seq((2, 8)))  # the pool holds 2 blocks: (1, 8) is demoted
    m = cache.match_prefix(seq((1, 8), (9, 1)))  # promoted back, demoting (2, 8)
    assert m.num_tokens == 8
    assert plain.kinds() == [("insert", 8, 8), ("insert", 8, 8)]
    assert [(e.kind, e.token_ids[0], e.offloaded) for e in detail.events] == [
        ("insert", 1, False),
        ("demote", 1, True),
        ("insert", 2, False),
        ("demote", 2, True),
        ("promote", 1, False),
    ]


def test_eviction_from_the_tier_says_the_run_was_offloaded() -> None:
    cache = tiered(pool=2, tier=2)
    rec = Recorder()
    cache.add_listener(rec)
    store(cache, seq((1, 8)))
    store(cache, seq((2, 8)))
    store(cache, seq((3, 8)))  # (2, 8) is demoted; (1, 8) is dropped from the tier
    assert [(e.kind, e.token_ids[0], e.offloaded) for e in rec.events if e.kind == "evict"] == [
        ("evict", 1, True)
    ]
