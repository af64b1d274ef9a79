"""`RadixCache.snapshot`: a flat copy of the tree with per-node hits, access times and locks."""

from __future__ import annotations

from radixserve.cache import BlockPool, RadixCache
from radixserve.cache.tokens import decode

BS = 4


def _cache_with(*seqs: list[int], namespace: str | None = None) -> RadixCache:
    cache = RadixCache(BlockPool(64), BS)
    for seq in seqs:
        res = cache.insert(seq, cache.allocate(len(seq) // BS), namespace)
        cache.pool.free(res.duplicate_blocks)
    return cache


def test_snapshot_lists_parents_before_children() -> None:
    cache = _cache_with([1] * 8 + [2] * 4, [1] * 8 + [3] * 4)
    cache.insert([9] * 4, cache.allocate(1), "tenant")
    snap = cache.snapshot()
    assert snap.num_nodes == cache.stats().num_nodes == 4
    assert sorted(str(ns) for ns in snap.namespaces.values()) == ["None", "tenant"]
    for i, row in enumerate(snap.nodes()):
        assert row.parent < i
        assert (row.parent == -1) == (i in snap.namespaces)
    assert sorted(r.num_tokens for r in snap.nodes()) == [0, 0, 4, 4, 4, 8]


def test_match_counts_one_hit_on_every_node_of_the_matched_path() -> None:
    cache = _cache_with([1] * 8 + [2] * 4, [3] * 4)
    cache.match_prefix([1] * 8 + [2] * 4 + [7])
    cache.match_prefix([1] * 8 + [2] * 4 + [8])
    hits = {decode(r.head): r.hit_count for r in cache.snapshot(16).nodes() if r.parent >= 0}
    assert hits == {(1,) * 8 + (2,) * 4: 2, (3,) * 4: 0}


def test_split_keeps_earlier_hits_on_both_halves_and_counts_the_new_one_above() -> None:
    cache = _cache_with([1] * 8 + [2] * 4)
    cache.match_prefix([1] * 8 + [2] * 4 + [0])  # a hit on the whole run
    cache.match_prefix([1] * 4 + [5] * 4)  # splits it after one block: a hit on the upper half
    upper, lower = [r for r in cache.snapshot(16).nodes() if r.parent >= 0]
    assert (decode(upper.head), upper.hit_count) == ((1,) * 4, 2)
    assert (decode(lower.head), lower.hit_count) == ((1,) * 4 + (2,) * 4, 1)
    assert lower.parent == 1 and upper.access_time >= lower.access_time > 0.0


def test_snapshot_shows_locked_paths_and_copies_only_the_head_tokens() -> None:
    cache = _cache_with(list(range(16)))
    m = cache.match_prefix(list(range(16)))
    cache.lock(m.node)
    (row,) = [r for r in cache.snapshot(head_tokens=4).nodes() if r.parent >= 0]
    assert row.lock_ref == 1
    assert decode(row.head) == (0, 1, 2, 3)
    assert row.num_tokens == 16
    cache.unlock(m.node)
    assert [r.lock_ref for r in cache.snapshot().nodes()] == [0, 0]
