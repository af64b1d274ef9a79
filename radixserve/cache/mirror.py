"""Keep a mirror of another cache's contents from its events (the router's per-worker trees)."""

from __future__ import annotations

from radixserve.cache.base import PrefixCache
from radixserve.cache.types import CacheEvent


def apply_event(mirror: PrefixCache, event: CacheEvent) -> None:
    """Replay a `CacheEvent` of another cache on `mirror`, so it caches the same prefixes.

    Both caches must use the same block_size. Blocks for inserted tokens come from the
    mirror's own pool (evicting there if it is short, which makes the mirror forget its
    least recently used prefixes first), so they mean nothing. Replays count as lookups
    and accesses in the mirror's statistics. Moves between tiers change nothing; "clear"
    resets the mirror. To mirror a cache live, add
    `functools.partial(apply_event, mirror)` as its listener.
    """
    tokens = event.token_ids
    if event.kind in ("demote", "promote"):
        return  # still cached, only elsewhere
    if event.kind == "clear":
        mirror.reset()
        return
    if event.kind == "evict":
        # The source evicted the tail run of a leaf: everything from its first block down.
        start = len(tokens) - event.num_tokens
        mirror.evict_path(tokens[: start + mirror.block_size], event.namespace)
        return
    match = mirror.match_prefix(tokens, event.namespace)
    mirror.lock(match.node)
    try:
        fresh = mirror.allocate(len(tokens) // mirror.block_size - len(match.blocks))
        mirror.insert(tokens, match.blocks + fresh, event.namespace)
    finally:
        mirror.unlock(match.node)
