"""The radix prefix cache: a block pool and a token-keyed trie of KV blocks (pure Python)."""

from radixserve.cache.errors import CacheFullError, InvariantError
from radixserve.cache.eviction import EvictionPolicy, LRUPolicy, PriorityLRUPolicy
from radixserve.cache.mirror import apply_event
from radixserve.cache.node import RadixNode
from radixserve.cache.pool import BlockPool
from radixserve.cache.radix import RadixCache
from radixserve.cache.types import (
    BlockMover,
    CacheEvent,
    CacheStats,
    InsertResult,
    MatchResult,
    NodeRecord,
)

__all__ = [
    "BlockMover",
    "BlockPool",
    "CacheEvent",
    "CacheFullError",
    "CacheStats",
    "EvictionPolicy",
    "InsertResult",
    "InvariantError",
    "LRUPolicy",
    "MatchResult",
    "NodeRecord",
    "PriorityLRUPolicy",
    "RadixCache",
    "RadixNode",
    "apply_event",
]
