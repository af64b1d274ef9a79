"""Errors raised by the prefix cache and its block pool."""

from __future__ import annotations

from radixserve.errors import RadixServeError


class CacheFullError(RadixServeError):
    """The block pool cannot satisfy an allocation, even after evicting what it may."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"requested {requested} KV blocks but only {available} are available")
        self.requested = requested
        self.available = available


class InvariantError(AssertionError):
    """A cache's `check_invariants` found a broken invariant (a bug, never a user error)."""
