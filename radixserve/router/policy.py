"""Routing decisions as pure functions over snapshots of the workers' state (no I/O)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.options import option, types

POLICIES = ("cache_aware", "round_robin", "least_load", "random")

# Reasons a decision gives; they label the router's `decisions_total` metric.
CACHE_HIT = "cache_hit"  # longest cached prefix won
# No useful prefix anywhere: the worker with the most free cache, then the fewest in-flight.
MOST_FREE_CACHE = "most_free_cache"
LOAD_IMBALANCE = "load_imbalance"  # loads too uneven: least loaded first, cache second
LEAST_LOAD = "least_load"  # the least_load policy: fewest in-flight
ROUND_ROBIN = "round_robin"
RANDOM = "random"
REASONS = (CACHE_HIT, MOST_FREE_CACHE, LOAD_IMBALANCE, LEAST_LOAD, ROUND_ROBIN, RANDOM)


@dataclass(frozen=True)
class WorkerView:
    """What the policy sees of one healthy worker for one request."""

    index: int
    in_flight: int
    matched_tokens: int = 0  # longest prefix of this prompt cached on the worker
    # The match follows a cached path to its end (a later turn, a repeat); False when the
    # prompt only shares a prefix (a system prompt) with paths that go on elsewhere.
    continues: bool = True
    cached_blocks: int = 0  # blocks in the worker's cache (router's mirror and prompts in flight)
    total_blocks: int = 0  # the worker's KV pool size; 0 when unknown
    block_size: int = 1  # tokens a block, to compare workers whose blocks differ

    @property
    def free_blocks(self) -> int:
        """Blocks the worker's cache could still take without evicting (negative if unknown)."""
        return self.total_blocks - self.cached_blocks if self.total_blocks else -self.cached_blocks

    @property
    def free_tokens(self) -> int:
        """`free_blocks` in tokens."""
        return self.free_blocks * self.block_size


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of the cache_aware policy (see docs/router.md)."""

    # A prefix every worker holds (the chat template's system prompt) gains nothing, so it
    # never pins traffic to one worker.
    cache_threshold: float = option(
        0.3,
        "route by cache when the best match beats the least-loaded worker's by this fraction "
        "of the prompt",
        type=types.fraction,
    )
    # Loads are uneven when max - min in-flight > abs AND max > rel * min.
    balance_abs_threshold: int = option(
        4, "loads are uneven when max-min in-flight exceeds this ...", type=types.non_negative_int
    )
    balance_rel_threshold: float = option(
        1.5, "... and max exceeds this times min", type=types.float_in(1.0)
    )


@dataclass(frozen=True)
class Decision:
    """The chosen worker, why, and how many prompt tokens it is expected to have cached."""

    index: int
    reason: str
    matched_tokens: int


class NoWorkerError(Exception):
    """No healthy worker to route to."""


def is_imbalanced(loads: Sequence[int], cfg: PolicyConfig) -> bool:
    """Whether in-flight counts differ beyond both the absolute and the relative threshold."""
    lo, hi = min(loads), max(loads)
    return hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo


def placement(views: Sequence[WorkerView]) -> WorkerView:
    """Where a prompt no worker has useful cache for goes: the most free cache (in tokens), then
    the fewest in-flight requests, then the lowest index.

    Free cache, not in-flight count, is what spreads conversations: a worker that answers
    faster has fewer requests in flight at any moment, and placing by load alone sends it
    nearly every new conversation until its cache overflows (measured in docs/kv-events.md).
    The imbalance guard of `choose_cache_aware` still bounds the load this may leave uneven.
    """
    return min(views, key=lambda v: (-v.free_tokens, v.in_flight, v.index))


def choose_cache_aware(
    views: Sequence[WorkerView], prompt_len: int, cfg: PolicyConfig = PolicyConfig()
) -> Decision:
    """Longest cached prefix when it saves enough prefill, else most free cache; load first if
    uneven."""
    if not views:
        raise NoWorkerError("no healthy worker")
    if len(views) > 1 and is_imbalanced([v.in_flight for v in views], cfg):
        lo = min(v.in_flight for v in views)
        pick = max(
            (v for v in views if v.in_flight == lo),
            key=lambda v: (v.matched_tokens, v.free_tokens, -v.index),
        )
        return Decision(pick.index, LOAD_IMBALANCE, pick.matched_tokens)
    placed = placement(views)
    need = cfg.cache_threshold * prompt_len
    own = [v for v in views if v.continues and v.matched_tokens > 0]
    if prompt_len > 0 and own:
        best = max(own, key=lambda v: (v.matched_tokens, -v.in_flight, v.free_tokens, -v.index))
        if best.matched_tokens - placed.matched_tokens >= need:
            return Decision(best.index, CACHE_HIT, best.matched_tokens)
    if prompt_len > 0 and placed.matched_tokens > 0 and placed.matched_tokens >= need:
        return Decision(placed.index, CACHE_HIT, placed.matched_tokens)
    return Decision(placed.index, MOST_FREE_CACHE, placed.matched_tokens)


def rank_cache_aware(
    views: Sequence[WorkerView], prompt_len: int, cfg: PolicyConfig = PolicyConfig()
) -> list[Decision]:
    """Every worker in `choose_cache_aware`'s order: its pick, then its pick of the rest, ...

    For routers that hand a ranking to someone else (Ray Serve's RequestRouter falls back to
    the next rank when a replica is at its max_ongoing_requests).
    """
    left = list(views)
    out = []
    while left:
        d = choose_cache_aware(left, prompt_len, cfg)
        out.append(d)
        left = [v for v in left if v.index != d.index]
    return out


def choose_round_robin(views: Sequence[WorkerView], counter: int) -> Decision:
    """The `counter`-th healthy worker, cyclically."""
    if not views:
        raise NoWorkerError("no healthy worker")
    v = sorted(views, key=lambda v: v.index)[counter % len(views)]
    return Decision(v.index, ROUND_ROBIN, v.matched_tokens)


def choose_least_load(views: Sequence[WorkerView], counter: int = 0) -> Decision:
    """Fewest in-flight requests; ties are broken cyclically by `counter`."""
    if not views:
        raise NoWorkerError("no healthy worker")
    lo = min(v.in_flight for v in views)
    ties = sorted((v for v in views if v.in_flight == lo), key=lambda v: v.index)
    v = ties[counter % len(ties)]
    return Decision(v.index, LEAST_LOAD, v.matched_tokens)


def choose_random(views: Sequence[WorkerView], rng: random.Random) -> Decision:
    """A uniformly random healthy worker."""
    if not views:
        raise NoWorkerError("no healthy worker")
    v = rng.choice(list(views))
    return Decision(v.index, RANDOM, v.matched_tokens)


def choose(
    policy: str,
    views: Sequence[WorkerView],
    prompt_len: int,
    counter: int,
    rng: random.Random,
    cfg: PolicyConfig = PolicyConfig(),
) -> Decision:
    """Dispatch to the named policy."""
    if policy == "cache_aware":
        return choose_cache_aware(views, prompt_len, cfg)
    if policy == "round_robin":
        return choose_round_robin(views, counter)
    if policy == "least_load":
        return choose_least_load(views, counter)
    if policy == "random":
        return choose_random(views, rng)
    raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
