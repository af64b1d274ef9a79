"""Thrash detection: find blocks cached again soon after they were evicted."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


def block_hashes(namespace: Hashable, data: bytes, block_bytes: int, end: int) -> list[int]:
    """A chained hash per block of `data[:end]`: block i's hash names the whole prefix
    ending with it (the same tokens in another namespace or after another prefix differ)."""
    h = hash(namespace)
    out = []
    for off in range(0, end, block_bytes):
        h = hash((h, data[off : off + block_bytes]))
        out.append(h)
    return out


class RefetchTracker:
    """Remembers which block prefixes were evicted when, for `window_s` seconds.

    A block inserted again within the window was re-prefilled because of that eviction
    (`inserted` says how many were). At most `max_entries` evictions are remembered (oldest
    go).
    """

    def __init__(self, window_s: float, clock: Callable[[], float], max_entries: int) -> None:
        self.window_s = window_s
        self.clock = clock
        self.max_entries = max(1, max_entries)
        self._evicted: OrderedDict[int, float] = OrderedDict()

    def evicted(self, namespace: Hashable, path: bytes, first_block: int, block_bytes: int) -> None:
        """Blocks `first_block`.. of the packed path `path` were evicted now."""
        now = self.clock()
        seen = self._evicted
        for h in block_hashes(namespace, path, block_bytes, len(path))[first_block:]:
            seen[h] = now
            seen.move_to_end(h)
        while len(seen) > self.max_entries:
            seen.popitem(last=False)

    def inserted(
        self, namespace: Hashable, data: bytes, first_block: int, end: int, block_bytes: int
    ) -> int:
        """Blocks `first_block`.. of `data[:end]` were just cached; returns how many of them
        had been evicted within the window (and forgets those evictions)."""
        seen = self._evicted
        if not seen:
            return 0
        cutoff = self.clock() - self.window_s
        while seen and next(iter(seen.values())) < cutoff:
            seen.popitem(last=False)
        n = 0
        for h in block_hashes(namespace, data, block_bytes, end)[first_block:]:
            if seen.pop(h, None) is not None:
                n += 1
        return n
