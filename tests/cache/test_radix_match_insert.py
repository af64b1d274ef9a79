"""match_prefix, peek_prefix and insert: what is cached, splits, duplicates, namespaces."""

from __future__ import annotations

from array import array

import pytest

from radixserve.cache import RadixNode

from .helpers import BS, make_cache, put, seq


def test_empty_cache_matches_nothing() -> None:
    cache = make_cache()
    m = cache.match_prefix(seq((1, 8)))
    assert (m.num_tokens, m.blocks) == (0, [])
    assert m.node.is_root


def test_inserted_sequence_matches_fully_with_its_blocks() -> None:
    cache = make_cache()
    tokens = seq((1, 4), (2, 4), (3, 4))
    blocks = cache.pool.allocate(3)
    assert cache.insert(tokens, blocks).num_cached_tokens == 0
    m = cache.match_prefix(tokens)
    assert (m.num_tokens, m.blocks) == (12, blocks)
    cache.check_invariants(num_private_blocks=0)


def test_match_counts_only_whole_blocks() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    assert cache.match_prefix(seq((1, 7))).num_tokens == 4


def test_match_shorter_than_one_block_returns_nothing() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    m = cache.match_prefix(seq((1, 3)))
    assert (m.num_tokens, m.blocks) == (0, [])
    assert m.node.is_root


def test_match_stops_at_first_differing_block() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4), (3, 4)))
    assert cache.match_prefix(seq((1, 4), (2, 3), (9, 1), (3, 4))).num_tokens == 4


def test_match_splits_node_at_block_boundary() -> None:
    cache = make_cache()
    tokens = seq((1, 4), (2, 4), (3, 4), (4, 4))
    result = put(cache, tokens)
    leaf = result.node
    original_blocks = list(leaf.blocks)
    m = cache.match_prefix(tokens[:8] + [7] * 8)
    assert m.num_tokens == 8
    assert m.blocks == original_blocks[:2]
    assert m.node is not leaf and m.node.blocks == original_blocks[:2]
    assert leaf.parent is m.node and leaf.blocks == original_blocks[2:]
    assert m.node.token_ids == tuple(tokens[:8]) and leaf.token_ids == tuple(tokens[8:])
    assert cache.stats().num_nodes == 2
    cache.check_invariants(num_private_blocks=0)


def test_split_in_middle_of_long_edge_keeps_both_halves_matchable() -> None:
    cache = make_cache(num_blocks=128)
    tokens = list(range(100, 100 + 25 * BS))
    blocks = put(cache, tokens).node.blocks[:]
    assert cache.match_prefix(tokens[: 13 * BS] + [0] * BS).num_tokens == 13 * BS
    full = cache.match_prefix(tokens)
    assert (full.num_tokens, full.blocks) == (len(tokens), blocks)
    cache.check_invariants(num_private_blocks=0)


def test_match_ending_inside_node_without_divergence_splits_too() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4), (3, 4)))
    m = cache.match_prefix(seq((1, 4), (2, 4)))
    assert m.num_tokens == 8 and m.node.num_tokens == 8
    assert len(m.node.children) == 1


def test_match_of_long_query_over_short_path_matches_the_path() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    assert cache.match_prefix(seq((1, 8), (2, 400))).num_tokens == 8


def test_match_accepts_tuples_and_uint32_arrays() -> None:
    cache = make_cache()
    tokens = [5, 70000, 2**32 - 1, 0] * 3
    put(cache, tokens)
    assert cache.match_prefix(tuple(tokens)).num_tokens == 12
    assert cache.match_prefix(array("I", tokens)).num_tokens == 12
    assert cache.peek_prefix(array("I", tokens[:9])) == 8


def test_token_ids_out_of_uint32_range_are_rejected() -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        cache.match_prefix([2**32] * BS)
    with pytest.raises(ValueError):
        cache.insert([-1] * BS, cache.pool.allocate(1))


def test_peek_prefix_neither_splits_nor_touches_nor_counts() -> None:
    cache = make_cache()
    node = put(cache, seq((1, 4), (2, 4), (3, 4))).node
    before = (node.last_access, cache.stats())
    assert cache.peek_prefix(seq((1, 4), (2, 4), (9, 4))) == 8
    assert cache.peek_prefix(seq((1, 2))) == 0
    assert (node.last_access, cache.stats()) == before
    assert node.parent is not None and node.parent.is_root


def test_match_updates_access_time_of_the_matched_path() -> None:
    cache = make_cache()
    a = put(cache, seq((1, 4), (2, 4))).node
    b = put(cache, seq((1, 4), (3, 4))).node
    assert a.last_access < b.last_access
    cache.match_prefix(seq((1, 4), (2, 4)))
    assert a.last_access > b.last_access
    assert a.parent is not None and a.parent.last_access == a.last_access


def test_insert_reports_already_cached_prefix_and_duplicate_blocks() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4)))
    blocks = cache.pool.allocate(3)
    result = cache.insert(seq((1, 4), (2, 4), (3, 4)), blocks)
    assert result.num_cached_tokens == 8
    assert result.duplicate_blocks == blocks[:2]
    assert cache.match_prefix(seq((1, 4), (2, 4), (3, 4))).blocks[2] == blocks[2]
    cache.pool.free(result.duplicate_blocks)
    cache.check_invariants(num_private_blocks=0)


def test_insert_does_not_report_the_trees_own_blocks_as_duplicates() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    m = cache.match_prefix(seq((1, 8), (2, 4)))
    cache.lock(m.node)
    private = cache.pool.allocate(1)
    result = cache.insert(seq((1, 8), (2, 4)), m.blocks + private)
    assert (result.num_cached_tokens, result.duplicate_blocks) == (8, [])
    cache.unlock(m.node)
    cache.check_invariants(num_private_blocks=0)


def test_insert_that_extends_a_leaf_adds_a_child_without_copying_blocks() -> None:
    cache = make_cache()
    first = put(cache, seq((1, 8))).node
    first_blocks = list(first.blocks)
    second = put(cache, seq((1, 8), (2, 4))).node
    assert second.parent is first and first.blocks == first_blocks
    assert second.token_ids == tuple(seq((2, 4)))
    assert cache.stats().num_nodes == 2
    cache.check_invariants(num_private_blocks=0)


def test_insert_of_strict_prefix_splits_and_adds_nothing() -> None:
    cache = make_cache()
    put(cache, seq((1, 4), (2, 4), (3, 4)))
    blocks = cache.pool.allocate(2)
    result = cache.insert(seq((1, 4), (2, 4)), blocks)
    assert result.num_cached_tokens == 8 and result.duplicate_blocks == blocks
    assert result.node.num_tokens == 8 and len(result.node.children) == 1
    cache.pool.free(blocks)
    assert cache.stats().cached_blocks == 3
    cache.check_invariants(num_private_blocks=0)


def test_inserts_sharing_some_blocks_branch_at_the_divergence() -> None:
    cache = make_cache()
    a = put(cache, seq((1, 4), (2, 4), (3, 4))).node
    b = put(cache, seq((1, 4), (2, 4), (4, 4), (5, 4))).node
    assert a.parent is b.parent
    shared = a.parent
    assert shared is not None and shared.token_ids == tuple(seq((1, 4), (2, 4)))
    assert sorted(shared.children) == sorted([a.tokens[: 4 * BS], b.tokens[: 4 * BS]])
    assert cache.stats().cached_blocks == 5
    cache.check_invariants(num_private_blocks=0)


def test_insert_diverging_inside_first_block_makes_a_sibling_at_the_root() -> None:
    cache = make_cache()
    a = put(cache, seq((1, 8))).node
    b = put(cache, [1, 1, 1, 2] + seq((1, 4))).node
    assert a.parent is b.parent and b.parent is not None and b.parent.is_root


def test_insert_of_identical_sequence_returns_all_blocks_as_duplicates() -> None:
    cache = make_cache()
    node = put(cache, seq((1, 8))).node
    blocks = cache.pool.allocate(2)
    result = cache.insert(seq((1, 8)), blocks)
    assert (result.num_cached_tokens, result.node, result.duplicate_blocks) == (8, node, blocks)


def test_insert_with_wrong_number_of_blocks_raises() -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert(seq((1, 8)), cache.pool.allocate(1))
    with pytest.raises(ValueError):
        cache.insert(seq((1, 6)), cache.pool.allocate(2))


@pytest.mark.parametrize("bad", [[1], [-1], [64], [0, 1]])
def test_insert_of_free_or_foreign_blocks_raises_and_changes_nothing(bad: list[int]) -> None:
    cache = make_cache()
    assert cache.pool.allocate(1) == [0]  # block 0 is allocated, block 1 is free
    with pytest.raises(ValueError, match="allocated"):
        cache.insert(seq((1, 4 * len(bad))), bad)
    assert cache.stats().cached_blocks == 0 and cache.stats().inserts == 0


def test_empty_insert_returns_the_root() -> None:
    cache = make_cache()
    result = cache.insert([], [])
    assert result.num_cached_tokens == 0 and result.node.is_root


def test_insert_raises_priority_along_the_path_to_the_maximum() -> None:
    cache = make_cache()
    low = put(cache, seq((1, 4), (2, 4)), priority=1).node
    high = put(cache, seq((1, 4), (3, 4)), priority=5).node
    assert (low.priority, high.priority) == (1, 5)
    assert high.parent is not None and high.parent.priority == 5
    put(cache, seq((1, 4), (2, 4)), priority=0)
    assert low.priority == 1


def test_namespaces_never_share_entries() -> None:
    cache = make_cache()
    tokens = seq((1, 8))
    put(cache, tokens, namespace="alice")
    assert cache.match_prefix(tokens).num_tokens == 0
    assert cache.match_prefix(tokens, namespace="bob").num_tokens == 0
    assert cache.peek_prefix(tokens, namespace="alice") == 8
    bob = put(cache, tokens, namespace="bob")
    assert bob.num_cached_tokens == 0
    a = cache.match_prefix(tokens, namespace="alice")
    b = cache.match_prefix(tokens, namespace="bob")
    assert set(a.blocks).isdisjoint(b.blocks)
    cache.check_invariants(num_private_blocks=0)


def test_node_handles_survive_splits_above_them() -> None:
    cache = make_cache()
    tokens = seq((1, 4), (2, 4), (3, 4))
    node: RadixNode = put(cache, tokens).node
    cache.lock(node)
    cache.match_prefix(seq((1, 4), (9, 4)))
    cache.match_prefix(seq((1, 4), (2, 4), (9, 4)))
    assert node.token_ids == tuple(seq((3, 4)))
    assert cache.stats().locked_blocks == 3
    cache.unlock(node)
    assert cache.stats().locked_blocks == 0
    cache.check_invariants(num_private_blocks=0)


def test_match_on_many_single_block_nodes_returns_blocks_in_order() -> None:
    cache = make_cache(num_blocks=256)
    tokens = list(range(64 * BS))
    blocks: list[int] = []
    for i in range(1, 65):  # one node per block: every prefix inserted separately
        result = cache.insert(tokens[: i * BS], blocks + cache.pool.allocate(1))
        blocks = [*blocks, *cache.match_prefix(tokens[: i * BS]).blocks[len(blocks) :]]
        assert result.num_cached_tokens == (i - 1) * BS
    assert cache.stats().num_nodes == 64
    assert cache.match_prefix(tokens).blocks == blocks
    cache.check_invariants(num_private_blocks=0)
