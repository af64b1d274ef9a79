"""lock/unlock, evict, allocate, policies and stats."""

from __future__ import annotations

import pytest

from radixserve.cache import CacheFullError, PriorityLRUPolicy

from .helpers import BS, make_cache, put, seq


def test_lock_pins_the_whole_path_and_unlock_releases_it() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4)))
    leaf = put(cache, seq((1, 4), (2, 4), (3, 4))).node
    cache.lock(leaf)
    assert cache.stats().locked_blocks == 3 and cache.stats().evictable_blocks == 0
    cache.unlock(leaf)
    assert cache.stats().locked_blocks == 0 and cache.stats().evictable_blocks == 3


def test_locks_nest() -> None:
    cache = make_cache()
    node = put(cache, seq((1, 8))).node
    cache.lock(node)
    cache.lock(node)
    cache.unlock(node)
    assert cache.evict(10) == 0
    cache.unlock(node)
    assert cache.evict(10) == 2


def test_unlock_below_zero_raises() -> None:
    cache = make_cache()
    node = put(cache, seq((1, 4))).node
    with pytest.raises(ValueError):
        cache.unlock(node)


def test_lock_and_unlock_of_a_root_are_no_ops() -> None:
    cache = make_cache()
    root = cache.match_prefix(seq((1, 4))).node
    cache.lock(root)
    cache.unlock(root)
    cache.unlock(root)
    cache.check_invariants(num_private_blocks=0)


def test_lock_of_an_evicted_node_raises() -> None:
    cache = make_cache()
    node = put(cache, seq((1, 4))).node
    cache.evict(1)
    with pytest.raises(ValueError):
        cache.lock(node)


def test_evict_frees_least_recently_used_leaf_first() -> None:
    cache = make_cache()
    old = put(cache, seq((1, 8))).node
    new = put(cache, seq((2, 8))).node
    cache.match_prefix(seq((1, 8)))  # now (2, 8) is the least recently used
    assert cache.evict(2) == 2
    assert new.removed and not old.removed
    assert cache.peek_prefix(seq((1, 8))) == 8 and cache.peek_prefix(seq((2, 8))) == 0


def test_evict_returns_blocks_to_the_pool() -> None:
    cache = make_cache(num_blocks=8)
    put(cache, seq((1, 16)))
    assert cache.pool.num_free == 4
    assert cache.evict(4) == 4
    assert cache.pool.num_free == 8
    cache.check_invariants(num_private_blocks=0)


def test_evict_takes_only_the_tail_blocks_it_needs_from_a_leaf() -> None:
    cache = make_cache()
    node = put(cache, seq((1, 4), (2, 4), (3, 4), (4, 4))).node
    assert cache.evict(1) == 1
    assert not node.removed and node.num_tokens == 12
    assert cache.peek_prefix(seq((1, 4), (2, 4), (3, 4), (4, 4))) == 12
    cache.check_invariants(num_private_blocks=0)


def test_eviction_cascades_up_a_chain_in_one_call() -> None:
    cache = make_cache()
    tokens = seq((1, 4), (2, 4), (3, 4), (4, 4))
    for i in range(1, 5):  # a chain of four one-block nodes
        put(cache, tokens[: i * BS])
    assert cache.stats().num_nodes == 4
    assert cache.evict(4) == 4
    assert cache.stats().num_nodes == 0 and cache.stats().cached_blocks == 0
    cache.check_invariants(num_private_blocks=0)


def test_eviction_never_touches_a_locked_path() -> None:
    cache = make_cache()
    locked = put(cache, seq((1, 4), (2, 4))).node
    put(cache, seq((1, 4), (3, 4)))
    put(cache, seq((5, 8)))
    cache.lock(locked)
    assert cache.evict(100) == 3
    assert cache.peek_prefix(seq((1, 4), (2, 4))) == 8
    assert cache.stats().cached_blocks == cache.stats().locked_blocks == 2
    cache.check_invariants(num_private_blocks=0)


def test_evict_more_than_evictable_frees_everything_evictable() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    put(cache, seq((2, 12)))
    assert cache.evict(1000) == 5
    assert cache.evict(1) == 0
    assert cache.stats().cached_blocks == 0


def test_evict_zero_or_negative_frees_nothing() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    assert cache.evict(0) == 0 and cache.evict(-3) == 0
    assert cache.stats().cached_blocks == 2


def test_unlocked_leaf_becomes_evictable_again() -> None:
    cache = make_cache()
    node = put(cache, seq((1, 8))).node
    cache.lock(node)
    assert cache.evict(2) == 0
    cache.unlock(node)
    assert cache.evict(2) == 2


def test_parent_left_with_only_a_locked_child_is_not_evicted() -> None:
    cache = make_cache()
    shared = seq((1, 4))
    keep = put(cache, shared + seq((2, 4))).node
    put(cache, shared + seq((3, 4)))
    cache.lock(keep)
    assert cache.evict(100) == 1
    assert cache.peek_prefix(shared + seq((2, 4))) == 8


def test_priority_policy_evicts_lower_tier_first_then_lru() -> None:
    cache = make_cache(policy=PriorityLRUPolicy())
    important = put(cache, seq((1, 4)), priority=2).node
    old_normal = put(cache, seq((2, 4))).node
    new_normal = put(cache, seq((3, 4))).node
    cache.match_prefix(seq((2, 4)))
    assert cache.evict(1) == 1 and new_normal.removed
    assert cache.evict(1) == 1 and old_normal.removed
    assert not important.removed


def test_lru_policy_ignores_priority() -> None:
    cache = make_cache()
    old = put(cache, seq((1, 4)), priority=9).node
    put(cache, seq((2, 4)))
    cache.evict(1)
    assert old.removed


def test_allocate_evicts_when_the_pool_is_short() -> None:
    cache = make_cache(num_blocks=4)
    put(cache, seq((1, 12)))
    blocks = cache.allocate(3)
    assert len(blocks) == 3 and cache.stats().cached_blocks == 1
    cache.check_invariants(num_private_blocks=3)


def test_allocate_beyond_free_plus_evictable_raises_without_evicting() -> None:
    cache = make_cache(num_blocks=4)
    node = put(cache, seq((1, 8))).node
    put(cache, seq((2, 4)))
    cache.lock(node)
    with pytest.raises(CacheFullError):
        cache.allocate(3)
    assert cache.stats().cached_blocks == 3


def test_stats_count_lookups_hits_misses_inserts_and_evictions() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    cache.match_prefix(seq((1, 8), (2, 3)))  # 8 hit, 3 missed (a partial block is a miss)
    cache.match_prefix(seq((3, 5)))
    cache.evict(1)
    stats = cache.stats()
    assert (stats.lookups, stats.hit_tokens, stats.missed_tokens) == (2, 8, 8)
    assert (stats.inserts, stats.inserted_blocks, stats.evicted_blocks) == (1, 2, 1)
    assert (stats.cached_blocks, stats.num_nodes, stats.free_blocks) == (1, 1, 63)
    assert stats.hit_rate == 0.5
    assert stats.as_dict()["hit_rate"] == 0.5 and stats.as_dict()["lookups"] == 2


def test_empty_namespace_root_is_forgotten_after_eviction() -> None:
    cache = make_cache()
    put(cache, seq((1, 4)), namespace="tenant")
    cache.evict(1)
    assert cache.match_prefix(seq((1, 4)), namespace="tenant").num_tokens == 0
    put(cache, seq((1, 4)), namespace="tenant")
    assert cache.peek_prefix(seq((1, 4)), namespace="tenant") == 4
    cache.check_invariants(num_private_blocks=0)


def test_heap_does_not_grow_with_repeated_lock_cycles() -> None:
    cache = make_cache()
    node = put(cache, seq((1, 4))).node
    for _ in range(1000):
        cache.lock(node)
        cache.unlock(node)
        cache.match_prefix(seq((1, 4)))
    assert len(cache._queues._queues[None]._heap) <= 2  # white-box: the lazy heap stays small
