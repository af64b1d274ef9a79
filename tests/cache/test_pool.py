from __future__ import annotations

import pytest

from radixserve.cache import BlockPool, CacheFullError
from radixserve.errors import RadixServeError


def test_new_pool_has_every_block_free() -> None:
    pool = BlockPool(8)
    assert (pool.num_total, pool.num_free, pool.num_used) == (8, 8, 0)


def test_allocate_returns_distinct_ids_in_range_and_counts_them() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(3) + pool.allocate(5)
    assert sorted(ids) == list(range(8))
    assert (pool.num_free, pool.num_used) == (0, 8)


def test_allocate_zero_returns_empty_list() -> None:
    assert BlockPool(2).allocate(0) == []


def test_allocate_more_than_free_raises_and_takes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(CacheFullError) as info:
        pool.allocate(2)
    assert (info.value.requested, info.value.available) == (2, 1)
    assert pool.num_free == 1
    assert isinstance(info.value, RadixServeError)


def test_allocate_negative_raises_value_error() -> None:
    with pytest.raises(ValueError):
        BlockPool(4).allocate(-1)


def test_freed_blocks_can_be_allocated_again() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(4)
    pool.free(ids[:2])
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == sorted(ids[:2])


def test_double_free_raises() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(ValueError, match="already free"):
        pool.free([ids[0]])


def test_free_of_same_id_twice_in_one_call_raises_and_frees_nothing() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.free([ids[0], ids[1], ids[0]])
    assert pool.num_free == 2
    assert not pool.is_free(ids[0]) and not pool.is_free(ids[1])


@pytest.mark.parametrize("foreign", [-1, 4, 100, True, 1.0])
def test_free_of_foreign_id_raises_and_frees_nothing(foreign: object) -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    with pytest.raises(ValueError, match="does not belong"):
        pool.free([ids[0], foreign])  # type: ignore[list-item]
    assert pool.num_free == 2


def test_is_free_tracks_allocation() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    assert not pool.is_free(block)
    pool.free([block])
    assert pool.is_free(block)


def test_negative_pool_size_is_rejected() -> None:
    with pytest.raises(ValueError):
        BlockPool(-1)


def test_all_used_is_true_only_for_allocated_pool_ids() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    assert pool.all_used(ids) and pool.all_used([])
    assert not pool.all_used([*ids, 3])
    assert not pool.all_used([-1]) and not pool.all_used([4])
