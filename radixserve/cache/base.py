"""The prefix-cache contract: what the engine may ask of a cache, on (`RadixCache`) or off
(`NullCache`)."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar

from radixserve.cache.counters import CacheCounters
from radixserve.cache.eviction import EvictionPolicy
from radixserve.cache.node import RadixNode
from radixserve.cache.pool import BlockPool
from radixserve.cache.snapshot import TreeSnapshot
from radixserve.cache.tokens import TokenIds
from radixserve.cache.types import CacheEvent, CacheStats, InsertResult, MatchResult, NodeRecord

logger = logging.getLogger(__name__)

Listener = Callable[[CacheEvent], None]
PLAIN_KINDS = ("insert", "evict")  # what a listener hears without asking for detail


class PrefixCache(ABC):
    """Token prefixes -> KV blocks of `pool`, in whole blocks of `block_size` tokens.

    The whole contract: find (`match_prefix`, `peek_prefix`), add (`insert`), pin
    (`lock`/`unlock`), free (`evict`, `evict_path`, `reset`), hand out blocks (`allocate`), report
    (`stats`, listeners, `leaf_paths`, `snapshot`), save and load (`export_nodes`,
    `restore_nodes`) and check itself (`check_invariants`). Every method is thread-safe (one
    re-entrant `_mutex`). To lock a node is to pin its path against eviction (a lock count
    per node, the `locked_blocks` of the stats); the window pool's `pin` is its counterpart
    for window slots. `enabled` is False only for the cache that caches nothing
    (`NullCache`).
    """

    enabled: ClassVar[bool]

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.counters = CacheCounters()  # read them through `stats()`
        # Re-entrant, so that listeners, and a subclass's own steps, may call public methods.
        self._mutex = threading.RLock()
        # Every listener -> whether it asked for detail (see `add_listener`).
        self._listeners: dict[Listener, bool] = {}

    # ----------------------------------------------------------------- settings

    @property
    @abstractmethod
    def policy(self) -> EvictionPolicy:
        """The eviction policy ordering unlocked leaves."""

    @property
    @abstractmethod
    def namespace_quota_blocks(self) -> int | None:
        """Unlocked blocks one namespace may keep at others' expense (None: no quota)."""

    # ----------------------------------------------------------------- lookups

    @abstractmethod
    def match_prefix(
        self, token_ids: TokenIds, namespace: Hashable = None, count: bool = True
    ) -> MatchResult:
        """The longest cached prefix of `token_ids` in whole blocks, counted as a lookup
        and a hit of its nodes unless not `count` (the engine's own reads, as a K/V
        handoff's); lock its node before the next `evict` or `allocate` to keep its blocks."""

    @abstractmethod
    def peek_prefix(self, token_ids: TokenIds, namespace: Hashable = None) -> int:
        """How many leading tokens of `token_ids` are cached (whole blocks); changes nothing."""

    def continuation(
        self, token_ids: TokenIds, namespace: Hashable = None, max_tokens: int = 8
    ) -> list[int]:
        """Up to `max_tokens` token ids that follow `token_ids` along a cached path (the most
        recently used branch where it forks), or [] when `token_ids` is not on one; changes
        nothing. A cache that holds nothing has no continuation."""
        return []

    # ----------------------------------------------------------------- mutation

    @abstractmethod
    def insert(
        self,
        token_ids: TokenIds,
        blocks: Sequence[int],
        namespace: Hashable = None,
        priority: int = 0,
        session: bool = False,
    ) -> InsertResult:
        """Offer `blocks` (holding the KV of `token_ids`) to the cache. The cache keeps the
        blocks on the path to the result's `node`; the caller keeps every other block."""

    @abstractmethod
    def lock(self, node: RadixNode) -> None:
        """Pin the path root..`node` (a node this cache returned) until a matching `unlock`."""

    @abstractmethod
    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`."""

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` pool blocks from unlocked leaves; returns how many."""

    @abstractmethod
    def evict_path(self, token_ids: TokenIds, namespace: Hashable = None) -> int:
        """Forget the unlocked cached subtree at the last block of `token_ids`; returns the
        pool blocks freed."""

    @abstractmethod
    def reset(self) -> int:
        """Forget every cached node no request pins, in the pool and the offload tier;
        returns the pool blocks freed. Listeners: see `add_listener`."""

    @abstractmethod
    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` blocks from the pool, evicting if it is short; raises CacheFullError,
        taking nothing, when free plus evictable blocks are too few."""

    # ----------------------------------------------------------------- observers

    def stats(self) -> CacheStats:
        """A consistent snapshot of sizes and counters."""
        with self._mutex:
            return self.counters.freeze(self.pool)

    def add_listener(self, listener: Listener, *, detail: bool = False) -> None:
        """Call `listener(event)` after every change of the cached set, under the cache lock.

        With `detail`, also after every move of a run between the pool and the offload tier
        ("demote" / "promote"), and a `reset` arrives as one "clear" (then an "insert" per
        node that stayed) instead of one "evict" per dropped run (see `CacheEvent`).
        A listener may read this cache (the lock is re-entrant) but must not mutate it or
        wait on another thread that uses it. Exceptions it raises are logged and
        swallowed, so one bad listener cannot break the cache or the other listeners.
        """
        with self._mutex:
            self._listeners[listener] = detail

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling `listener`; raises ValueError if it was not added."""
        with self._mutex:
            if self._listeners.pop(listener, None) is None:
                raise ValueError(f"{listener!r} is not a listener of this cache")

    @property
    def _detail_wanted(self) -> bool:
        """Whether a listener asked for tier moves and resets (`add_listener(detail=True)`)."""
        return any(self._listeners.values())

    @abstractmethod
    def leaf_paths(self) -> list[tuple[Hashable, tuple[int, ...]]]:
        """(namespace, token ids from the root) of every cached leaf."""

    @abstractmethod
    def snapshot(self, head_tokens: int = 32) -> TreeSnapshot:
        """A copy of every node's shape and counters, for observers (see `snapshot.py`)."""

    @abstractmethod
    def export_nodes(self) -> list[NodeRecord]:
        """Every cached node, parents before children (for saving the cache)."""

    @abstractmethod
    def restore_nodes(self, records: Sequence[NodeRecord]) -> list[RadixNode | None]:
        """Rebuild exported nodes with fresh blocks, evicting nothing; each record's new node
        (whose blocks the caller fills with the saved K/V) or None if it was not restored."""

    @abstractmethod
    def check_invariants(self, num_private_blocks: int | None = None) -> None:
        """Raise InvariantError on any broken invariant; with `num_private_blocks` (held by
        requests outside the cache) also check free + cached + private == total."""

    def _emit(self, events: list[CacheEvent], detailed: list[CacheEvent] | None = None) -> None:
        """Tell the listeners: plain ones get the "insert" / "evict" events of `events`;
        those that asked for detail get `detailed` where given, else all of `events`."""
        for listener, detail in list(self._listeners.items()):
            if detail:
                chosen = events if detailed is None else detailed
            else:
                chosen = [e for e in events if e.kind in PLAIN_KINDS]
            for event in chosen:
                try:
                    listener(event)
                except Exception:
                    logger.exception("cache listener %r failed on %s", listener, event.kind)
