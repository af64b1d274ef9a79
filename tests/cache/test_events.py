"""Listeners, evict_path and mirroring a cache from its events."""

from __future__ import annotations

import functools
import random

from radixserve.cache import BlockPool, CacheEvent, RadixCache, apply_event

from .helpers import BS, Recorder, make_cache, put, seq


def test_insert_event_carries_the_full_path_and_the_new_run() -> None:
    cache = make_cache()
    rec = Recorder()
    cache.add_listener(rec)
    put(cache, seq((1, 8)), namespace="ns")
    put(cache, seq((1, 8), (2, 4)), namespace="ns")
    assert rec.events == [
        CacheEvent("insert", "ns", tuple(seq((1, 8))), 8),
        CacheEvent("insert", "ns", tuple(seq((1, 8), (2, 4))), 4),
    ]


def test_insert_of_already_cached_tokens_and_splits_send_no_event() -> None:
    cache = make_cache()
    put(cache, seq((1, 12)))
    rec = Recorder()
    cache.add_listener(rec)
    put(cache, seq((1, 8)))
    cache.match_prefix(seq((1, 4), (2, 4)))
    assert rec.events == []


def test_evict_event_carries_the_path_to_the_end_of_the_evicted_node() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4)))
    put(cache, seq((1, 4), (3, 8)))
    rec = Recorder()
    cache.add_listener(rec)
    cache.evict(100)
    paths = [(e.kind, e.token_ids, e.num_tokens) for e in rec.events]
    assert paths == [
        ("evict", tuple(seq((1, 4), (2, 4))), 4),
        ("evict", tuple(seq((1, 4), (3, 8))), 8),
        ("evict", tuple(seq((1, 4))), 4),
    ]


def test_partial_eviction_event_names_only_the_trimmed_tail() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4), (3, 4)))
    rec = Recorder()
    cache.add_listener(rec)
    cache.evict(1)
    assert rec.kinds() == [("evict", 12, 4)]


def test_removed_listener_is_not_called() -> None:
    cache = make_cache()
    rec = Recorder()
    cache.add_listener(rec)
    cache.remove_listener(rec)
    put(cache, seq((1, 4)))
    assert rec.events == []


def test_failing_listener_does_not_break_the_cache_or_other_listeners() -> None:
    cache = make_cache()

    def broken(event: CacheEvent) -> None:
        raise RuntimeError("boom")

    rec = Recorder()
    cache.add_listener(broken)
    cache.add_listener(rec)
    put(cache, seq((1, 4)))
    assert len(rec.events) == 1
    cache.check_invariants(num_private_blocks=0)


def test_evict_path_removes_the_subtree_below_that_path() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4), (3, 4)))
    put(cache, seq((1, 4), (2, 4), (4, 4)))
    put(cache, seq((1, 4), (5, 4)))
    assert cache.evict_path(seq((1, 4), (2, 4))) == 3
    assert cache.peek_prefix(seq((1, 4), (2, 4))) == 4
    assert cache.peek_prefix(seq((1, 4), (5, 4))) == 8
    cache.check_invariants(num_private_blocks=0)


def test_evict_path_ending_inside_a_node_trims_from_that_block() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4), (3, 4), (4, 4)))
    assert cache.evict_path(seq((1, 4), (2, 4), (3, 4))) == 2
    assert cache.peek_prefix(seq((1, 4), (2, 4), (3, 4), (4, 4))) == 8
    cache.check_invariants(num_private_blocks=0)


def test_evict_path_of_uncached_path_frees_nothing() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    assert cache.evict_path(seq((1, 8), (2, 4))) == 0
    assert cache.evict_path(seq((2, 4)), namespace="other") == 0
    assert cache.stats().cached_blocks == 2


def test_evict_path_keeps_locked_nodes_and_removes_unlocked_siblings() -> None:
    cache = make_cache()
    locked = put(cache, seq((1, 4), (2, 4))).node
    put(cache, seq((1, 4), (3, 4)))
    cache.lock(locked)
    assert cache.evict_path(seq((1, 4))) == 1
    assert cache.peek_prefix(seq((1, 4), (2, 4))) == 8
    assert cache.peek_prefix(seq((1, 4), (3, 4))) == 4
    cache.unlock(locked)
    cache.check_invariants(num_private_blocks=0)


def test_evict_path_sends_evict_events() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4)))
    rec = Recorder()
    cache.add_listener(rec)
    cache.evict_path(seq((1, 4)))
    assert rec.kinds() == [("evict", 8, 8)]


def _cached_prefixes(cache: RadixCache, paths: list[list[int]]) -> list[int]:
    return [cache.peek_prefix(p) for p in paths]


def test_mirror_fed_by_events_caches_exactly_the_same_prefixes() -> None:
    rng = random.Random(7)
    source = RadixCache(BlockPool(40), block_size=BS)
    mirror = RadixCache(BlockPool(10_000), block_size=BS)
    source.add_listener(functools.partial(apply_event, mirror))
    paths = [[rng.randrange(3) for _ in range(BS * rng.randrange(1, 6))] for _ in range(60)]
    for path in paths:
        m = source.match_prefix(path)
        source.lock(m.node)
        fresh = source.allocate(len(path) // BS - len(m.blocks))
        result = source.insert(path, m.blocks + fresh)
        source.pool.free(result.duplicate_blocks)
        source.unlock(m.node)
        if rng.random() < 0.3:
            source.evict(rng.randrange(1, 8))
        assert _cached_prefixes(mirror, paths) == _cached_prefixes(source, paths)
    assert mirror.stats().cached_blocks == source.stats().cached_blocks
    mirror.check_invariants(num_private_blocks=0)


def test_leaf_paths_list_every_cached_root_to_leaf_path() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4)))
    put(cache, seq((1, 4), (3, 4)), namespace="x")
    put(cache, seq((1, 4), (4, 4)))
    assert sorted(cache.leaf_paths(), key=repr) == sorted(
        [
            (None, tuple(seq((1, 4), (2, 4)))),
            (None, tuple(seq((1, 4), (4, 4)))),
            ("x", tuple(seq((1, 4), (3, 4)))),
        ],
        key=repr,
    )


def test_mirror_follows_a_leaf_trimmed_by_one_block() -> None:
    source, mirror = make_cache(), make_cache()
    source.add_listener(functools.partial(apply_event, mirror))
    put(source, seq((1, 4), (2, 4)))
    put(source, seq((1, 4), (3, 4)))
    source.evict(1)
    assert sorted(mirror.leaf_paths(), key=repr) == sorted(source.leaf_paths(), key=repr)
