"""Random insert/match/lock/unlock/evict sequences against a naive model of the cached set.

The model is a dict from (namespace, block-prefix tuple) to the block id caching that
prefix's last block, plus the logical time each prefix was last used. Block size 2 and
a vocabulary of 3 tokens make paths collide, split and share all the time.

The machine runs once per eviction policy. Under LRU the evicted prefixes must be older
than every kept leaf (by the model's clock); under the others, every leaf an eviction took
must have had a key no larger than every evictable leaf it kept (by the policy's keys,
read just before the eviction). With a namespace quota the order is the quota's, and only
the shared checks apply.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache import (
    BlockPool,
    CacheFullError,
    EvictionKey,
    EvictionPolicy,
    RadixCache,
    RadixNode,
    SessionRetention,
    SLRUPolicy,
    make_policy,
)
from radixserve.cache.eviction import is_evictable
from radixserve.cache.trie import post_order

from .helpers import Recorder

BS = 2
TOTAL_BLOCKS = 24

# Common stems plus a random tail, so requests often share and extend each other's paths.
STEMS = [[], [0, 0], [0, 0, 1, 1], [0, 0, 1, 1, 2, 2, 0, 1], [1, 2, 1]]
tokens_st = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from(STEMS),
    st.lists(st.integers(0, 2), max_size=8),
)
namespace_st = st.sampled_from([None, "b"])
Key = tuple[Hashable, tuple[int, ...]]


@dataclass
class Request:
    """A running request: its whole-block tokens, pinned match and private blocks."""

    tokens: list[int]
    namespace: Hashable
    node: RadixNode
    matched: list[int]
    private: list[int]


class CacheMachine(RuleBasedStateMachine):
    make: Callable[[Callable[[], float]], EvictionPolicy] = staticmethod(
        lambda clock: make_policy("lru")
    )
    order = "lru"  # "lru": the model's clock; "keys": the policy's keys; "none": quota order
    quota: float | None = None

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.cache = RadixCache(
            BlockPool(TOTAL_BLOCKS),
            block_size=BS,
            policy=self.make(lambda: self.now),
            namespace_quota=self.quota,
            clock=lambda: self.now,
        )
        self.before: dict[RadixNode, tuple[EvictionKey, int]] = {}
        self.events = Recorder()
        self.cache.add_listener(self.events)
        self.block_of: dict[Key, int] = {}  # the model: cached prefix -> its last block
        self.used_at: dict[Key, int] = {}
        self.clock = 0
        self.requests: list[Request] = []

    # ------------------------------------------------------------ model helpers

    def prefixes(self, namespace: Hashable, tokens: list[int]) -> list[Key]:
        return [(namespace, tuple(tokens[: k * BS])) for k in range(1, len(tokens) // BS + 1)]

    def model_match(self, namespace: Hashable, tokens: list[int]) -> list[Key]:
        matched = []
        for key in self.prefixes(namespace, tokens):
            if key not in self.block_of:
                break
            matched.append(key)
        return matched

    def touch(self, keys: list[Key]) -> None:
        self.clock += 1
        for key in keys:
            self.used_at[key] = self.clock

    def locked_keys(self) -> set[Key]:
        return {
            key
            for r in self.requests
            for key in self.prefixes(r.namespace, r.tokens[: len(r.matched) * BS])
        }

    def evictable_leaves(self) -> list[Key]:
        locked = self.locked_keys()
        leaves = []
        for ns, prefix in self.block_of:
            extended = any(
                ns2 == ns and len(p2) == len(prefix) + BS and p2[: len(prefix)] == prefix
                for ns2, p2 in self.block_of
            )
            if not extended and (ns, prefix) not in locked:
                leaves.append((ns, prefix))
        return leaves

    def snapshot_keys(self) -> None:
        """Remember every evictable leaf's key and size just before an eviction may run."""
        self.now += 1.0  # session warmth runs out as the machine goes on
        key = self.cache.policy.key
        self.before = {
            n: (key(n), len(n.blocks)) for n in self.cache._queues.nodes() if is_evictable(n)
        }

    def check_key_order(self) -> None:
        taken = [k for n, (k, size) in self.before.items() if n.removed or len(n.blocks) < size]
        kept = [
            k for n, (k, size) in self.before.items() if not n.removed and len(n.blocks) == size
        ]
        if taken and kept:
            assert max(taken) <= min(kept), "evicted a leaf the policy ranks above a kept one"

    def apply_evict_events(self, since: int) -> set[Key]:
        removed: set[Key] = set()
        for event in self.events.events[since:]:
            assert event.kind == "evict"
            start = len(event.token_ids) - event.num_tokens
            for end in range(start + BS, len(event.token_ids) + 1, BS):
                removed.add((event.namespace, event.token_ids[:end]))
        assert removed <= set(self.block_of), "evicted something that was not cached"
        assert not removed & self.locked_keys(), "evicted a locked prefix"
        survivors = [k for k in self.evictable_leaves() if k not in removed]
        if self.order == "keys":
            self.check_key_order()
        elif self.order == "lru" and removed and survivors:
            newest_evicted = max(self.used_at[k] for k in removed)
            oldest_kept = min(self.used_at[k] for k in survivors)
            assert newest_evicted <= oldest_kept, "evicted a more recently used leaf first"
        for key in removed:
            del self.block_of[key]
            del self.used_at[key]
        return removed

    def pinned(self) -> int:
        return sum(len(r.private) for r in self.requests)

    # ------------------------------------------------------------ rules

    @rule(tokens=tokens_st, namespace=namespace_st)
    def match(self, tokens: list[int], namespace: Hashable) -> None:
        expected = self.model_match(namespace, tokens)
        assert self.cache.peek_prefix(tokens, namespace) == len(expected) * BS
        m = self.cache.match_prefix(tokens, namespace)
        assert m.num_tokens == len(expected) * BS
        assert m.blocks == [self.block_of[k] for k in expected]
        self.touch(expected)

    @rule(tokens=tokens_st, namespace=namespace_st)
    def start_request(self, tokens: list[int], namespace: Hashable) -> None:
        tokens = tokens[: len(tokens) // BS * BS]
        m = self.cache.match_prefix(tokens, namespace)
        matched = self.model_match(namespace, tokens)
        assert m.blocks == [self.block_of[k] for k in matched]
        self.touch(matched)
        self.cache.lock(m.node)
        self.snapshot_keys()
        since = len(self.events.events)
        evictable = self.cache.stats().evictable_blocks
        need = len(tokens) // BS - len(m.blocks)
        try:
            private = self.cache.allocate(need)
        except CacheFullError:
            assert need > self.cache.pool.num_free + evictable
            self.cache.unlock(m.node)
            return
        self.requests.append(Request(tokens, namespace, m.node, m.blocks, private))
        self.apply_evict_events(since)

    @rule(tokens=tokens_st, namespace=namespace_st)
    def insert_fresh(self, tokens: list[int], namespace: Hashable) -> None:
        """Insert with all-new blocks (no prior match): every cached one is a duplicate."""
        tokens = tokens[: len(tokens) // BS * BS]
        self.snapshot_keys()
        since = len(self.events.events)
        try:
            blocks = self.cache.allocate(len(tokens) // BS)
        except CacheFullError:
            return
        self.apply_evict_events(since)
        self.requests.append(
            Request(tokens, namespace, self.cache.match_prefix([]).node, [], blocks)
        )
        self.finish(len(self.requests) - 1)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), commit=st.booleans())
    def finish_request(self, data: st.DataObject, commit: bool) -> None:
        index = data.draw(st.integers(0, len(self.requests) - 1))
        if commit:
            self.finish(index)
        else:  # aborted: nothing is cached, private blocks go back
            req = self.requests.pop(index)
            self.cache.pool.free(req.private)
            self.cache.unlock(req.node)

    def finish(self, index: int) -> None:
        """Insert a request's tokens as the engine does, check the result, unpin it."""
        req = self.requests.pop(index)
        blocks = req.matched + req.private
        keys = self.prefixes(req.namespace, req.tokens)
        cached = self.model_match(req.namespace, req.tokens)
        # tiers and sessions vary with the request, so priority and retention have work
        result = self.cache.insert(
            req.tokens,
            blocks,
            req.namespace,
            priority=len(req.tokens) % 3,
            session=len(req.tokens) % 4 == 0,
        )
        assert result.num_cached_tokens == len(cached) * BS
        expected_dups = [b for b, k in zip(blocks, cached, strict=False) if self.block_of[k] != b]
        assert result.duplicate_blocks == expected_dups
        for key, block in zip(keys[len(cached) :], blocks[len(cached) :], strict=True):
            self.block_of[key] = block
        self.touch(keys)
        self.cache.pool.free(result.duplicate_blocks)
        self.cache.unlock(req.node)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        evictable = len(self.block_of) - len(self.locked_keys())
        assert self.cache.stats().evictable_blocks == evictable
        self.snapshot_keys()
        since = len(self.events.events)
        freed = self.cache.evict(n)
        assert freed == min(n, evictable)
        assert len(self.apply_evict_events(since)) == freed

    @precondition(lambda self: self.block_of)
    @rule(data=st.data())
    def evict_path(self, data: st.DataObject) -> None:
        namespace, prefix = data.draw(st.sampled_from(sorted(self.block_of, key=repr)))
        locked = self.locked_keys()
        expected = {
            (ns, p)
            for ns, p in self.block_of
            if ns == namespace and p[: len(prefix)] == prefix and (ns, p) not in locked
        }
        since = len(self.events.events)
        freed = self.cache.evict_path(list(prefix), namespace)
        assert freed == len(expected)
        removed: set[Key] = set()
        for event in self.events.events[since:]:
            start = len(event.token_ids) - event.num_tokens
            for end in range(start + BS, len(event.token_ids) + 1, BS):
                removed.add((event.namespace, event.token_ids[:end]))
        assert removed == expected
        for key in removed:
            del self.block_of[key]
            del self.used_at[key]

    # ------------------------------------------------------------ invariants

    @invariant()
    def invariants_hold(self) -> None:
        self.cache.check_invariants(num_private_blocks=self.pinned())
        self.policy_state_holds()
        stats = self.cache.stats()
        assert stats.cached_blocks == len(self.block_of)
        assert stats.free_blocks + stats.cached_blocks + self.pinned() == TOTAL_BLOCKS

    def policy_state_holds(self) -> None:
        """Per-node policy state agrees with the tree: a parent is worth at least its
        child (fanout), and the protected segment's count is its nodes' blocks (slru)."""
        policy = self.cache.policy
        base = policy.base if isinstance(policy, SessionRetention) else policy
        nodes = [n for root in self.cache._roots.values() for n in post_order(root)]
        for node in nodes:
            if node.parent is not None and node.parent.parent is not None:
                assert node.score <= node.parent.score
        if isinstance(base, SLRUPolicy):
            protected = sum(len(n.blocks) for n in nodes if n.protected)
            assert protected == base.protected_blocks
            assert protected <= int(base.protected_fraction * TOTAL_BLOCKS)

    def teardown(self) -> None:
        for req in self.requests:
            self.cache.unlock(req.node)
        assert self.cache.stats().locked_blocks == 0


CacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_cache_matches_reference_model = CacheMachine.TestCase


def _variant(name: str, make: Callable[[Callable[[], float]], EvictionPolicy], **attrs: object):
    cls = type(name, (CacheMachine,), {"make": staticmethod(make), "order": "keys", **attrs})
    cls.TestCase.settings = settings(CacheMachine.TestCase.settings, max_examples=60)
    return cls.TestCase


test_fanout_policy = _variant("FanoutMachine", lambda clock: make_policy("fanout"))
test_slru_policy = _variant("SLRUMachine", lambda clock: make_policy("slru"))
test_priority_policy = _variant("PriorityMachine", lambda clock: make_policy("priority"))
test_session_retention_over_slru = _variant(
    "SessionMachine", lambda clock: make_policy("slru", session_ttl=3.0, clock=clock)
)
test_namespace_quota = _variant(
    "QuotaMachine", lambda clock: make_policy("fanout"), order="none", quota=0.3
)
