"""The router's mirror of one worker's prefix cache, built on `radixserve.cache`'s trie.

The mirror is a `RadixCache` over a pool of placeholder block ids: it knows which token
prefixes the worker holds, not where their KV lives. It is fed either by the worker's cache
events (exact) or, without them, by the prompts the router sent there (an estimate, bounded
by the pool and evicted LRU like the worker's own cache).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Sequence

from radixserve.cache import BlockPool, CacheEvent, CacheFullError, RadixCache, apply_event

log = logging.getLogger(__name__)

Path = tuple[Hashable, tuple[int, ...]]


class WorkerTrie:
    """Which token prefixes (per namespace) one worker has cached, as far as the router knows."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.cache = RadixCache(BlockPool(capacity_blocks), block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks in the mirror."""
        return self.cache.pool.num_used

    def match(self, token_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Tokens of the longest cached prefix of `token_ids` (whole blocks). Read-only."""
        return self.cache.peek_prefix(token_ids, namespace)

    def continues(self, token_ids: Sequence[int], namespace: Hashable, matched: int) -> bool:
        """Whether `token_ids`, whose first `matched` tokens are cached, follows a cached path
        to within one block of where that path ends (a conversation's next turn, a repeat),
        rather than branching off a prefix that a cached path takes elsewhere (a system
        prompt or document that another request began with).
        """
        if matched <= 0:
            return False
        rest = token_ids[matched:]
        probe = min(len(rest), self.block_size)
        ahead = self.cache.continuation(token_ids[:matched], namespace, probe + self.block_size + 1)
        common = 0
        while common < probe and common < len(ahead) and ahead[common] == rest[common]:
            common += 1
        return common == len(rest) or len(ahead) - common <= self.block_size

    def insert(self, token_ids: Sequence[int], namespace: Hashable = None) -> None:
        """Record that the worker caches `token_ids` (cut to whole blocks and to capacity).

        Marks the path most recently used; evicts the mirror's LRU leaves if it is full.
        """
        n = min(len(token_ids) // self.block_size, self.capacity) * self.block_size
        if n == 0:
            return
        try:
            apply_event(self.cache, CacheEvent("insert", namespace, tuple(token_ids[:n]), n))
        except CacheFullError:  # cannot happen with nothing locked; never fail a route for it
            log.warning("router mirror full (%d blocks); insert dropped", self.capacity)

    def remove(
        self, token_ids: Sequence[int], namespace: Hashable = None, num_tokens: int | None = None
    ) -> None:
        """Record that the worker evicted the last `num_tokens` of the path `token_ids`.

        Without `num_tokens` only the path's last block (and anything below it) is dropped:
        the worker may have trimmed just that block, so the mirror errs towards keeping
        prefixes (see `Worker` for how such drift is detected and resynced).
        """
        n = len(token_ids) // self.block_size * self.block_size
        if n == 0:
            return
        tokens = tuple(token_ids[:n])
        if num_tokens is None or num_tokens <= 0:
            num_tokens = self.block_size
        num_tokens = min(n, (num_tokens + self.block_size - 1) // self.block_size * self.block_size)
        apply_event(self.cache, CacheEvent("evict", namespace, tokens, num_tokens))

    def load(self, paths: Iterable[tuple[Hashable, Sequence[int]]]) -> None:
        """Replace the contents with exactly `paths` (a snapshot of the worker's cache)."""
        self.clear()
        for namespace, token_ids in paths:
            self.insert(token_ids, namespace)

    def clear(self) -> None:
        """Forget everything."""
        self.cache = RadixCache(BlockPool(self.capacity), self.block_size)

    def paths(self) -> list[Path]:
        """Every cached root-to-leaf path as (namespace, token ids)."""
        return list(self.cache.leaf_paths())
