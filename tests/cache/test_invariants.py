"""check_invariants catches what the cache invariants (docs/architecture.md) forbid."""

from __future__ import annotations

import pytest

from radixserve.cache import InvariantError

from .helpers import make_cache, put, seq


def test_check_invariants_accepts_a_consistent_cache() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    private = cache.pool.allocate(3)
    cache.check_invariants(num_private_blocks=len(private))
    cache.check_invariants()


def test_check_invariants_detects_a_wrong_private_count() -> None:
    cache = make_cache()
    put(cache, seq((1, 8)))
    cache.pool.allocate(3)
    with pytest.raises(InvariantError, match="private"):
        cache.check_invariants(num_private_blocks=2)


def test_check_invariants_detects_a_tree_block_freed_behind_its_back() -> None:
    cache = make_cache()
    node = put(cache, seq((1, 8))).node
    cache.pool.free(node.blocks[:1])
    with pytest.raises(InvariantError, match="free"):
        cache.check_invariants()


def test_check_invariants_detects_a_block_owned_twice() -> None:
    cache = make_cache()
    put(cache, seq((1, 4)))
    second = put(cache, seq((2, 4))).node
    first_block = cache.match_prefix(seq((1, 4))).blocks[0]
    cache.pool.free(second.blocks)
    second.blocks[0] = first_block
    with pytest.raises(InvariantError, match="shared"):
        cache.check_invariants()


def test_check_invariants_detects_a_locked_node_under_an_unlocked_parent() -> None:
    cache = make_cache()
    put(cache, seq((1, 4)))
    leaf = put(cache, seq((1, 4), (2, 4))).node
    leaf.lock_ref = 1  # as if lock() had skipped the ancestors
    with pytest.raises(InvariantError, match="ancestor"):
        cache.check_invariants()


def test_invariant_error_is_an_assertion_error() -> None:
    assert issubclass(InvariantError, AssertionError)
