"""WindowSlots: the sliding-window layers' slots lent to block ids (cache/window.py), alone and
under a BlockPool, with a property test of its accounting against a plain model of it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import BlockPool, CacheFullError, InvariantError
from radixserve.cache.window import NO_SLOT, WindowSlots


def test_allocated_blocks_get_pinned_slots_and_freed_ones_give_them_back() -> None:
    window = WindowSlots(num_blocks=8, num_slots=3, window=8, block_size=4)
    pool = BlockPool(8, window)
    a = pool.allocate(3)
    assert all(window.slot_of(b) != NO_SLOT for b in a) and window.num_pinned == 3
    with pytest.raises(CacheFullError):
        pool.allocate(1)  # every slot pinned: the block pool has blocks, the window none
    assert pool.num_free == 5  # nothing taken
    window.unpin(a[:2])
    (b,) = pool.allocate(1)  # takes the least recently unpinned slot: a[0]'s
    assert window.slot_of(a[0]) == NO_SLOT and window.slot_of(a[1]) != NO_SLOT
    assert window.evicted == 1
    pool.free([a[0], a[2]])
    assert window.num_free == 1 and window.num_idle == 1 and window.num_pinned == 1
    window.check_invariants(b for b in range(8) if not pool.is_free(b))
    assert b not in a


def test_a_prefix_is_usable_up_to_the_last_point_whose_window_has_slots() -> None:
    window = WindowSlots(num_blocks=10, num_slots=10, window=8, block_size=4)
    pool = BlockPool(10, window)
    blocks = pool.allocate(6)  # 24 tokens
    assert window.usable(blocks, 24) == 24
    window.unpin(blocks)
    window.drop([blocks[0]])  # as if evicted: block 0 has no slot ...
    # ... still leaves 24: a query at 23 reads keys 16..23 (blocks 4, 5).
    assert window.usable(blocks, 24) == 24
    window.drop([blocks[4]])  # block 4 lost its slot: windows over 16..19 cannot be read
    # end 16: the last token recomputed at 15 reads keys 8..15, blocks 2 and 3: kept.
    assert window.usable(blocks, 24) == 16
    window.drop([blocks[2]])
    # end 8 reads keys 0..7: block 0 has no slot either.
    assert window.usable(blocks, 24) == 0
    assert window.usable(blocks[:2], 100) == 0  # never past the blocks given


def test_a_moved_slot_keeps_its_pins_and_its_place() -> None:
    window = WindowSlots(num_blocks=4, num_slots=2, window=4, block_size=4)
    window.take([0])
    window.move(0, 1)
    assert window.slot_of(0) == NO_SLOT and window.slot_of(1) != NO_SLOT
    assert window.num_pinned == 1
    with pytest.raises(ValueError):
        window.move(0, 2)  # no slot to move
    window.unpin([1])
    with pytest.raises(ValueError):
        window.unpin([1])  # not pinned
    with pytest.raises(ValueError):
        window.pin([0])  # no slot
    with pytest.raises(InvariantError):
        window.check_invariants([0])  # block 1 is not allocated yet holds a slot


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "pin", "unpin"]), st.integers(0, 40)),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 6))
def test_the_accounting_matches_a_plain_model(steps, num_slots) -> None:
    """Random allocations, frees, pins and unpins: a slot is never lost or held twice, pinned
    slots are never taken, and the least recently unpinned slot is the one evicted."""
    num_blocks = 12
    window = WindowSlots(num_blocks, num_slots, window=8, block_size=4)
    pool = BlockPool(num_blocks, window)
    pins: dict[int, int] = {}  # allocated block -> pins
    idle: list[int] = []  # slotted, unpinned, oldest first
    slotted: set[int] = set()
    for op, x in steps:
        used = sorted(pins)
        if op == "alloc":
            n = 1 + x % 3
            if n > pool.num_free or n > num_slots - sum(1 for b in slotted if pins[b]):
                with pytest.raises(CacheFullError):
                    pool.allocate(n)
                continue
            free_slots = num_slots - len(slotted)
            lost = idle[: max(0, n - free_slots)]
            got = pool.allocate(n)
            for b in lost:
                assert window.slot_of(b) == NO_SLOT
                slotted.discard(b)
            idle = idle[len(lost) :]
            for b in got:
                pins[b] = 1
                slotted.add(b)
        elif not used:
            continue
        elif op == "free":
            b = used[x % len(used)]
            pool.free([b])
            del pins[b]
            slotted.discard(b)
            if b in idle:
                idle.remove(b)
        elif op == "pin":
            b = used[x % len(used)]
            if b not in slotted:
                with pytest.raises(ValueError):
                    window.pin([b])
                continue
            window.pin([b])
            pins[b] += 1
            if b in idle:
                idle.remove(b)
        else:
            b = used[x % len(used)]
            if pins[b] == 0:
                continue
            window.unpin([b])
            pins[b] -= 1
            if pins[b] == 0 and b in slotted:
                idle.append(b)
        window.check_invariants(b for b in range(num_blocks) if not pool.is_free(b))
        assert {b for b in range(num_blocks) if window.slot_of(b) != NO_SLOT} == slotted
        assert window.num_idle == len(idle)
