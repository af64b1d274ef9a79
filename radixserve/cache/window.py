"""Which KV blocks still hold their sliding-window layers' K/V: the window pool's slots."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from radixserve.cache.errors import CacheFullError, InvariantError

NO_SLOT = -1


class WindowSlots:
    """The slots of the sliding-window layers' smaller K/V pool, lent to block ids.

    Every block id holds the full-attention layers' K/V; the windowed layers' K/V of a block
    lives in a slot while the block has one. A block gets a slot when it is allocated
    (`take`, pinned once for the request that allocated it) and keeps it while pinned (a
    running request's window may still read it). An unpinned slot stays with its block until
    another block needs it: the least recently unpinned goes first. A freed block gives its
    slot back (`drop`). A cached prefix of L tokens is a hit for the windowed layers only if
    the blocks of its last `window` tokens all have slots (`usable`).

    `slot_of(b)` is NO_SLOT for a block without one; `slot_array` holds every block's slot
    (int64, num_blocks + 1 entries, the last NO_SLOT: a pool's scratch block), kept current in
    place for a tensor viewing it. Thread-safe.
    """

    def __init__(self, num_blocks: int, num_slots: int, window: int, block_size: int) -> None:
        if num_slots < 1 or window < 1 or block_size < 1:
            raise ValueError("num_slots, window and block_size must be positive")
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.window = window
        self.block_size = block_size
        self.slot_array = array("q", [NO_SLOT] * (num_blocks + 1))
        self._slot = self.slot_array  # indexed by block id; never resized (viewed as a tensor)
        self._pins = [0] * num_blocks
        self._free = list(range(num_slots - 1, -1, -1))
        self._idle: OrderedDict[int, None] = OrderedDict()  # unpinned blocks with a slot
        self._mutex = threading.Lock()
        self.evicted = 0  # slots taken from unpinned blocks so far

    @property
    def num_free(self) -> int:
        """Slots no block holds."""
        return len(self._free)

    @property
    def num_idle(self) -> int:
        """Slots held by unpinned blocks (obtainable by evicting them)."""
        return len(self._idle)

    @property
    def num_pinned(self) -> int:
        """Slots held by pinned blocks."""
        return self.num_slots - len(self._free) - len(self._idle)

    def slot_of(self, block: int) -> int:
        """The slot holding `block`'s windowed K/V, or NO_SLOT."""
        return self._slot[block]

    def take(self, blocks: Sequence[int]) -> None:
        """Give each of `blocks` (newly allocated, slotless) a slot, pinned once. Evicts the
        least recently unpinned slots when no free ones are left; raises CacheFullError,
        changing nothing, when free plus unpinned slots are too few."""
        with self._mutex:
            if len(blocks) > len(self._free) + len(self._idle):
                raise CacheFullError(len(blocks), len(self._free) + len(self._idle))
            for b in blocks:
                if self._slot[b] != NO_SLOT:
                    raise ValueError(f"block {b} already has window slot {self._slot[b]}")
                if not self._free:
                    victim, _ = self._idle.popitem(last=False)
                    self._free.append(self._slot[victim])
                    self._slot[victim] = NO_SLOT
                    self.evicted += 1
                self._slot[b] = self._free.pop()
                self._pins[b] = 1

    def drop(self, blocks: Iterable[int]) -> None:
        """Forget `blocks` (returned to the block pool): their slots become free, pins gone."""
        with self._mutex:
            for b in blocks:
                slot = self._slot[b]
                if slot != NO_SLOT:
                    self._idle.pop(b, None)
                    self._free.append(slot)
                    self._slot[b] = NO_SLOT
                self._pins[b] = 0

    def pin(self, blocks: Iterable[int]) -> None:
        """One more reader for each of `blocks`; each must have a slot."""
        with self._mutex:
            for b in blocks:
                if self._slot[b] == NO_SLOT:
                    raise ValueError(f"block {b} has no window slot to pin")
                self._pins[b] += 1
                self._idle.pop(b, None)

    def unpin(self, blocks: Iterable[int]) -> None:
        """One reader fewer for each of `blocks`; a slot left with none becomes evictable,
        the most recently unpinned last."""
        with self._mutex:
            for b in blocks:
                if self._pins[b] <= 0:
                    raise ValueError(f"block {b} is not pinned")
                self._pins[b] -= 1
                if self._pins[b] == 0 and self._slot[b] != NO_SLOT:
                    self._idle[b] = None

    def move(self, src: int, dst: int) -> None:
        """Hand `src`'s slot (and its pins) to `dst`, which has none: the two blocks hold the
        same tokens' K/V (a block published twice keeps the tree's copy)."""
        with self._mutex:
            slot = self._slot[src]
            if slot == NO_SLOT or self._slot[dst] != NO_SLOT:
                raise ValueError(f"cannot move window slot of block {src} to block {dst}")
            self._slot[dst], self._slot[src] = slot, NO_SLOT
            self._pins[dst] += self._pins[src]
            self._pins[src] = 0
            self._idle.pop(src, None)
            if self._pins[dst] == 0:
                self._idle[dst] = None

    def first_needed(self, position: int) -> int:
        """Index of the first block a query at `position` (or later) reads."""
        return max(0, position - self.window + 1) // self.block_size

    def usable(self, blocks: Sequence[int], num_tokens: int) -> int:
        """The longest prefix (a whole number of blocks, at most `num_tokens`) of a cached
        path over `blocks` after which the windowed layers can go on: the blocks its last
        `window` tokens lie in all have slots."""
        bs = self.block_size
        end = min(num_tokens, len(blocks) * bs) // bs * bs
        with self._mutex:
            while end > 0:
                lo = self.first_needed(end - 1)  # a full hit recomputes its last token
                missing = next(
                    (j for j in range(end // bs - 1, lo - 1, -1) if self._slot[blocks[j]] < 0),
                    None,
                )
                if missing is None:
                    return end
                end = missing * bs
        return 0

    def check_invariants(self, used: Iterable[int]) -> None:
        """Raise InvariantError unless every slot is free, idle or pinned exactly once over,
        and only blocks in `used` (the block pool's allocated ids) hold slots or pins."""
        with self._mutex:
            used_set = set(used)
            held = [b for b in range(self.num_blocks) if self._slot[b] != NO_SLOT]
            slots = [self._slot[b] for b in held] + self._free
            if sorted(slots) != list(range(self.num_slots)):
                raise InvariantError("window slots lost or held twice")
            for b in held:
                if b not in used_set:
                    raise InvariantError(f"free block {b} holds window slot {self._slot[b]}")
                if (self._pins[b] == 0) != (b in self._idle):
                    raise InvariantError(f"block {b}: pinned and idle disagree")
            for b in self._idle:
                if self._slot[b] == NO_SLOT:
                    raise InvariantError(f"idle block {b} has no slot")
            if self._slot[self.num_blocks] != NO_SLOT:
                raise InvariantError("the scratch block holds a window slot")
            for b, pins in enumerate(self._pins):
                if pins < 0 or (pins and self._slot[b] == NO_SLOT):
                    raise InvariantError(f"block {b} has {pins} pins and slot {self._slot[b]}")
