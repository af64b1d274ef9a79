"""Build the prefix cache an engine's settings describe: off, plain, or with an offload tier."""

from __future__ import annotations

from radixserve.cache.base import PrefixCache
from radixserve.cache.null import NullCache
from radixserve.cache.policies import make_policy
from radixserve.cache.pool import BlockPool
from radixserve.cache.radix import RadixCache
from radixserve.cache.tiered import TieredRadixCache
from radixserve.cache.types import BlockMover
from radixserve.cache.window import WindowSlots


def make_prefix_cache(
    *,
    num_blocks: int,
    block_size: int,
    enabled: bool,
    eviction_policy: str,
    session_ttl: float,
    namespace_quota: float | None,
    refetch_window: float,
    tier_blocks: int,
    mover: BlockMover | None,
    window: WindowSlots | None = None,
) -> PrefixCache:
    """A cache over a fresh pool of `num_blocks`: a `NullCache` when not `enabled`, else a
    `RadixCache`, tiered over a second pool of `tier_blocks` (0: none) whose bytes `mover`
    copies. With `window`, the pool lends sliding-window layers' slots too (not with a tier).

    The policy is built (and an unknown `eviction_policy` or a negative `session_ttl`
    raises ValueError) even when the cache is off, so a bad setting never waits for the
    cache to be turned on. A tier without a mover, or a mover without a tier, raises too.
    """
    policy = make_policy(eviction_policy, session_ttl)
    if (tier_blocks > 0) != (mover is not None):
        raise ValueError("an offload tier needs a mover, and a mover a tier")
    if window is not None and tier_blocks > 0:
        raise ValueError("a window pool does not go with an offload tier")
    pool = BlockPool(num_blocks, window)
    if not enabled:
        return NullCache(pool, block_size, policy)
    if mover is None:
        return RadixCache(
            pool,
            block_size,
            policy,
            namespace_quota=namespace_quota,
            refetch_window_s=refetch_window,
        )
    return TieredRadixCache(
        pool,
        block_size,
        policy,
        BlockPool(tier_blocks),
        mover,
        namespace_quota=namespace_quota,
        refetch_window_s=refetch_window,
    )
