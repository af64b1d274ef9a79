"""The fixed set of physical KV block ids and its free list."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from radixserve.cache.errors import CacheFullError
from radixserve.cache.window import WindowSlots


class BlockPool:
    """Hands out block ids 0..num_blocks-1; knows nothing of tokens or the tree.

    Every id is either free (here) or used (held by the tree or a running request).
    Allocation is all or nothing. Thread-safe. With `window` (a model with sliding-window
    layers whose K/V live in a smaller pool), every allocated block also gets a window slot
    and a freed one gives its slot back; allocation fails when slots run short too.
    """

    def __init__(self, num_blocks: int, window: WindowSlots | None = None) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._total = num_blocks
        # A stack: allocate pops from the end, so the first allocations get 0, 1, 2, ...
        # and freed blocks are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_blocks
        self._mutex = threading.Lock()
        self.window = window

    @property
    def num_total(self) -> int:
        """Number of block ids the pool manages."""
        return self._total

    @property
    def num_free(self) -> int:
        """Number of blocks that can be allocated now."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Number of blocks allocated and not yet freed."""
        return self._total - len(self._free)

    def is_free(self, block_id: int) -> bool:
        """Whether `block_id` is currently free; raise ValueError if it is not a pool id."""
        self._check_id(block_id)
        return bool(self._is_free[block_id])

    def all_used(self, ids: Sequence[int]) -> bool:
        """Whether every id in `ids` is a pool id that is currently allocated (C-speed scan)."""
        if not ids:
            return True
        if min(ids) < 0 or max(ids) >= self._total:
            return False
        return 1 not in map(self._is_free.__getitem__, ids)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks; return their ids. If short, raise CacheFullError, taking none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        with self._mutex:
            if n > len(self._free):
                raise CacheFullError(n, len(self._free))
            if n == 0:
                return []
            ids = self._free[-n:]
            ids.reverse()
            if self.window is not None:
                self.window.take(ids)  # CacheFullError, taking nothing, if slots are short
            del self._free[-n:]
            is_free = self._is_free
            for block_id in ids:
                is_free[block_id] = 0
            return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks to the free list.

        All or nothing: raises ValueError, freeing none, if an id is not a pool id,
        is already free, or appears twice.
        """
        ids = list(ids)
        with self._mutex:
            is_free = self._is_free
            for i, block_id in enumerate(ids):
                if not self._owns(block_id) or is_free[block_id]:
                    for done in ids[:i]:
                        is_free[done] = 0
                    self._check_id(block_id)
                    raise ValueError(f"block {block_id} is already free (double free)")
                is_free[block_id] = 1
            if self.window is not None:
                self.window.drop(ids)
            ids.reverse()
            self._free.extend(ids)

    def _owns(self, block_id: int) -> bool:
        return type(block_id) is int and 0 <= block_id < self._total

    def _check_id(self, block_id: int) -> None:
        if not self._owns(block_id):
            raise ValueError(f"block id {block_id!r} does not belong to this pool")

    def __repr__(self) -> str:
        return f"BlockPool(num_total={self._total}, num_free={self.num_free})"
