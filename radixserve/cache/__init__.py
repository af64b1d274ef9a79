"""The prefix cache: a block pool and a token-keyed trie of KV blocks (pure Python).

`PrefixCache` (base.py) is the contract; `RadixCache` (radix.py) implements it,
`TieredRadixCache` (tiered.py) adds an offload tier, `NullCache` (null.py) is the cache
turned off, and `make_prefix_cache` (factory.py) builds the one an engine asks for.
"""

from radixserve.cache.base import Listener, PrefixCache
from radixserve.cache.counters import CacheCounters
from radixserve.cache.errors import CacheFullError, InvariantError
from radixserve.cache.eviction import EvictionKey, EvictionPolicy, LRUPolicy, PriorityLRUPolicy
from radixserve.cache.factory import make_prefix_cache
from radixserve.cache.mirror import apply_event
from radixserve.cache.node import RadixNode
from radixserve.cache.null import NullCache
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
from radixserve.cache.tiered import TieredRadixCache
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
    "CacheCounters",
    "CacheEvent",
    "CacheFullError",
    "CacheStats",
    "EvictionKey",
    "EvictionPolicy",
    "FanoutPolicy",
    "InsertResult",
    "InvariantError",
    "LRUPolicy",
    "Listener",
    "MatchResult",
    "NodeRecord",
    "NodeRow",
    "NullCache",
    "PrefixCache",
    "PriorityLRUPolicy",
    "RadixCache",
    "RadixNode",
    "TieredRadixCache",
    "TreeSnapshot",
    "SLRUPolicy",
    "SessionRetention",
    "apply_event",
    "make_policy",
    "make_prefix_cache",
]
