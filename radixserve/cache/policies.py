"""Eviction policies beyond plain LRU, and `make_policy`, which builds one by name.

- `fanout`: a node is worth the requests that reused it, decayed over logical time; a hit
  through a node is a hit on every ancestor, so a shared preamble outlives its suffixes.
- `slru`: segmented LRU; a new path is probationary until its second use, and a burst of
  one-off prompts only ever evicts probationary paths while protected ones stay.
- `priority`: tiers first (request `priority`, or the API key's tier), LRU within a tier.
- `SessionRetention`: wraps any of them; paths of requests with a session id stay warm
  (evicted only after every cold leaf) for a number of seconds after each turn.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from radixserve.cache.eviction import EvictionKey, EvictionPolicy, LRUPolicy, PriorityLRUPolicy
from radixserve.cache.node import RadixNode

Clock = Callable[[], float]


def _logaddexp(a: float, b: float) -> float:
    hi, lo = (a, b) if a >= b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))


class FanoutPolicy(EvictionPolicy):
    """Fewest decayed reuses first: a hit adds exp(tick / decay_ticks) to a node's worth.

    Comparing sum(exp(-(now - t_i) / d)) between nodes at one `now` is comparing
    sum(exp(t_i / d)), which only grows, so keys never shrink; `score` keeps its log.
    A node used once ranks by its time of use (as LRU); each reuse buys it about
    `decay_ticks` * ln(uses) ticks (lookups + inserts) of newer one-off traffic.
    """

    name = "fanout"

    def __init__(self, decay_ticks: float = 512.0) -> None:
        if decay_ticks <= 0:
            raise ValueError("decay_ticks must be > 0")
        self.decay_ticks = decay_ticks

    def key(self, node: RadixNode) -> EvictionKey:
        """The log of the node's decayed hit count, in units of decay_ticks."""
        return (node.score,)

    def on_hit(self, path: Sequence[RadixNode], tick: int) -> None:
        """Count one more reuse on every node of the matched path."""
        x = tick / self.decay_ticks
        for node in path:
            node.score = _logaddexp(node.score, x)

    def on_insert(
        self,
        path: Sequence[RadixNode],
        new: RadixNode | None,
        tick: int,
        session: bool,
        reused: bool,
    ) -> None:
        """A new node counts as used once now (twice if `reused`); older ones are worth
        at least that."""
        x = tick / self.decay_ticks
        for node in path:
            if node.score < x:
                node.score = x
        if new is not None and reused:
            new.score = x + math.log(2.0)
            for node in path:
                node.score = max(node.score, new.score)


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: probationary leaves first, then protected ones, LRU within each.

    A path is promoted to the protected segment when a lookup hits it (its second use), or
    when it is cached again soon after its eviction (a ghost hit, as 2Q's A1out list; the
    cache's refetch tracker remembers recent evictions).
    The protected segment holds at most `protected_fraction` of the pool; promotions past
    that demote its least recently used nodes back to probation.
    """

    name = "slru"

    def __init__(self, protected_fraction: float = 0.8) -> None:
        if not 0.0 < protected_fraction <= 1.0:
            raise ValueError("protected_fraction must be in (0, 1]")
        self.protected_fraction = protected_fraction
        self._cap = 0
        self._protected: OrderedDict[RadixNode, None] = OrderedDict()
        self._protected_blocks = 0
        self._fallen: list[RadixNode] = []

    @property
    def protected_blocks(self) -> int:
        """Blocks held by protected nodes now."""
        return self._protected_blocks

    def bind(self, num_blocks: int) -> None:
        """Size the protected segment from the pool."""
        self._cap = max(1, int(self.protected_fraction * num_blocks))

    def key(self, node: RadixNode) -> EvictionKey:
        """Segment (probation 0, protected 1), then last access time."""
        return (1.0 if node.protected else 0.0, node.last_access)

    def on_hit(self, path: Sequence[RadixNode], tick: int) -> None:
        """Promote (or refresh) the matched path; demote the protected LRU past the cap."""
        seg = self._protected
        for node in path:
            if node.protected:
                seg.move_to_end(node)
            else:
                node.protected = True
                seg[node] = None
                self._protected_blocks += len(node.blocks)
        while self._protected_blocks > self._cap and seg:
            old, _ = seg.popitem(last=False)
            old.protected = False
            self._protected_blocks -= len(old.blocks)
            self._fallen.append(old)

    def on_insert(
        self,
        path: Sequence[RadixNode],
        new: RadixNode | None,
        tick: int,
        session: bool,
        reused: bool,
    ) -> None:
        """A path evicted shortly before and cached again is on its second use: promoted."""
        if new is not None and reused:
            self.on_hit([new], tick)

    def on_split(self, upper: RadixNode, lower: RadixNode) -> None:
        """The upper half joins the segment of the node it came from."""
        if upper.protected:
            self._protected[upper] = None

    def on_drop(self, node: RadixNode, num_blocks: int) -> None:
        """Evicted blocks leave the segment's count."""
        if node.protected:
            self._protected_blocks -= num_blocks
            if node.removed:
                node.protected = False
                del self._protected[node]

    def fallen(self) -> Sequence[RadixNode]:
        """Nodes demoted since the last call."""
        out, self._fallen = self._fallen, []
        return out


class SessionRetention(EvictionPolicy):
    """Wraps a policy: a session request's path stays warm for `ttl_s` seconds after it is
    inserted; warm leaves are evicted only after every cold one (base order within each)."""

    def __init__(self, base: EvictionPolicy, ttl_s: float, clock: Clock = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self.base = base
        self.ttl_s = ttl_s
        self.clock = clock
        self.name = base.name
        self._expiry: list[tuple[float, int, RadixNode]] = []
        self._seq = itertools.count()

    def key(self, node: RadixNode) -> EvictionKey:
        """Warm (1) or not (0), then the base policy's key."""
        return (1.0 if node.warm_until > self.clock() else 0.0, *self.base.key(node))

    def bind(self, num_blocks: int) -> None:
        """Passed on to the base policy."""
        self.base.bind(num_blocks)

    def on_hit(self, path: Sequence[RadixNode], tick: int) -> None:
        """Passed on to the base policy."""
        self.base.on_hit(path, tick)

    def on_insert(
        self,
        path: Sequence[RadixNode],
        new: RadixNode | None,
        tick: int,
        session: bool,
        reused: bool,
    ) -> None:
        """A session's turn keeps its whole path warm for ttl_s from now."""
        self.base.on_insert(path, new, tick, session, reused)
        if not session:
            return
        until = self.clock() + self.ttl_s
        for node in path:
            node.warm_until = until
            heapq.heappush(self._expiry, (until, next(self._seq), node))

    def on_split(self, upper: RadixNode, lower: RadixNode) -> None:
        """Passed on to the base policy (the cache copied `warm_until`)."""
        self.base.on_split(upper, lower)
        if upper.warm_until:
            heapq.heappush(self._expiry, (upper.warm_until, next(self._seq), upper))

    def on_drop(self, node: RadixNode, num_blocks: int) -> None:
        """Passed on to the base policy."""
        self.base.on_drop(node, num_blocks)

    def fallen(self) -> Sequence[RadixNode]:
        """Nodes whose warmth ran out since the last call, plus the base policy's."""
        now = self.clock()
        out = list(self.base.fallen())
        exp = self._expiry
        while exp and exp[0][0] <= now:
            until, _, node = heapq.heappop(exp)
            if not node.removed and node.warm_until == until:
                out.append(node)
        return out


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fanout": FanoutPolicy,
    "slru": SLRUPolicy,
    "priority": PriorityLRUPolicy,
}
DEFAULT_POLICY = "fanout"
"""The engine's default, chosen by measurement (docs/eviction.md)."""


def make_policy(
    name: str = DEFAULT_POLICY, session_ttl: float = 0.0, clock: Clock = time.monotonic
) -> EvictionPolicy:
    """A fresh policy by name; with `session_ttl` > 0, wrapped in `SessionRetention`.

    Raises ValueError naming the choices for an unknown name.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICIES)}")
    if session_ttl < 0:
        raise ValueError("session_ttl must be >= 0")
    policy = POLICIES[name]()
    return SessionRetention(policy, session_ttl, clock) if session_ttl > 0 else policy
