"""An engine's counters and gauges: what /metrics and /v1/cache/stats report."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.engine.kv_manager import KVCacheManager
from radixserve.engine.scheduler import Scheduler


@dataclass
class EngineCounters:
    """The counters the engine loop itself keeps (the cache and scheduler keep theirs)."""

    requests_total: dict[str, int] = field(default_factory=dict)  # by finish reason
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    spec_decode_num_drafts: int = 0  # verifications with at least one drafted token
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


@dataclass
class EngineStats:
    """Monotonic counters and current gauges of an engine."""

    requests_total: dict[str, int] = field(default_factory=dict)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    spec_decode_num_drafts: int = 0  # verifications with at least one drafted token
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    evicted_blocks_total: int = 0
    refetch_blocks_total: int = 0
    preemptions_total: int = 0
    num_waiting: int = 0
    num_running: int = 0
    blocks_total: int = 0
    blocks_free: int = 0
    blocks_cached: int = 0
    blocks_locked: int = 0
    prefix_cache_offload_hits_total: int = 0
    blocks_offloaded: int = 0
    offload_blocks_total: int = 0


def collect_stats(
    counters: EngineCounters, kv: KVCacheManager, scheduler: Scheduler, num_inbox: int
) -> EngineStats:
    """The engine's stats now, from its counters, its blocks' owners and its queues (the
    inbox holds requests not yet handed to the scheduler)."""
    cache = kv.cache.stats()  # all zeros with the cache off
    return EngineStats(
        requests_total=dict(counters.requests_total),
        prompt_tokens_total=counters.prompt_tokens_total,
        generation_tokens_total=counters.generation_tokens_total,
        spec_decode_num_drafts=counters.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=counters.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=counters.spec_decode_num_accepted_tokens,
        prefix_cache_queries_total=kv.prefix_cache_queries,
        prefix_cache_hits_total=kv.prefix_cache_hits,
        evicted_blocks_total=cache.evicted_blocks,
        refetch_blocks_total=cache.refetch_blocks,
        preemptions_total=scheduler.num_preemptions,
        num_waiting=len(scheduler.waiting) + num_inbox,
        num_running=len(scheduler.running),
        blocks_total=kv.num_blocks,
        blocks_free=kv.pool.num_free,
        blocks_cached=cache.cached_blocks,
        blocks_locked=cache.locked_blocks,
        prefix_cache_offload_hits_total=cache.offload_hit_tokens,
        blocks_offloaded=cache.offloaded_blocks,
        offload_blocks_total=cache.offload_total_blocks,
    )


def cache_stats(kv: KVCacheManager) -> dict[str, object]:
    """The prefix cache's statistics plus pool counts and eviction settings, JSON-ready (the
    body of /v1/cache/stats)."""
    out: dict[str, object] = {}
    if kv.cache.enabled:
        out.update(kv.cache.stats().as_dict())
    else:
        out.update(cached_blocks=0, evictable_blocks=0, locked_blocks=0, num_nodes=0)
    out.update(
        enabled=kv.cache.enabled,
        block_size=kv.block_size,
        total_blocks=kv.num_blocks,
        free_blocks=kv.pool.num_free,
        private_blocks=kv.num_private_blocks,
        **kv.policy_info(),
    )
    if kv.window is not None:  # sliding-window layers in their own pool (cache/window.py)
        out.update(
            window_slots_total=kv.window.num_slots,
            window_slots_free=kv.window.num_free,
            window_slots_pinned=kv.window.num_pinned,
            window_slots_evicted=kv.window.evicted,
        )
    return out
