"""The radix prefix cache: a block pool and a token-keyed trie of KV blocks (pure Python)."""

from radixserve.cache.errors import CacheFullError, InvariantError
from radixserve.cache.eviction import EvictionKey, EvictionPolicy, LRUPolicy, PriorityLRUPolicy
from radixserve.cache.mirror import apply_event
from radixserve.cache.node import RadixNode
from radixserve.cache.policies import (
    DEFAULT_POLICY,
    POLICIES,
    FanoutPolicy,
    SessionRetention,
    SLRUPolicy,
    make_policy,
)
from radixserve.cache.pool import BlockPool
from radixserve.cache.radix import RadixCache
from radixserve.cache.snapshot import NodeRow, TreeSnapshot
from radixserve.cache.types import (
    BlockMover,
    CacheEvent,
    CacheStats,
    InsertResult,
    MatchResult,
    NodeRecord,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "BlockMover",
    "BlockPool",
    "CacheEvent",
    "CacheFullError",
    "CacheStats",
    "EvictionKey",
    "EvictionPolicy",
    "FanoutPolicy",
    "InsertResult",
    "InvariantError",
    "LRUPolicy",
    "MatchResult",
    "NodeRecord",
    "NodeRow",
    "PriorityLRUPolicy",
    "RadixCache",
    "RadixNode",
    "TreeSnapshot",
    "SLRUPolicy",
    "SessionRetention",
    "apply_event",
    "make_policy",
]
