"""KVCacheManager over each cache: random admit / compute / decode / release sequences.

Whatever the cache, after every step each block is in exactly one place (free, cached, or
one request's private list), every request's block table covers its computed tokens, and
once every request has ended no block is private. With the cache off (`NullCache`) nothing
is ever cached, shared or hit: every block a request holds is its own, and all of them are
free again when it ends. No model runs: the manager only moves block ids.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache import make_prefix_cache
from radixserve.engine.kv_manager import KVCacheManager
from radixserve.engine.request import Request

BS = 2
POOL = 16
MAX_RUNNING = 4

tokens_st = st.builds(
    lambda stem, tail: stem + tail,
    st.sampled_from([[], [0, 0], [0, 0, 1, 1], [1, 2, 1, 2, 0]]),
    st.lists(st.integers(0, 2), min_size=1, max_size=8),
)
namespace_st = st.sampled_from([None, "b"])


def _copy_block(src: int, dst: int) -> None:
    """The K/V copy of an exact repeat's last block: there are no bytes here to copy."""


class ManagerMachine(RuleBasedStateMachine):
    """Requests come, compute their prompts in chunks, decode, get preempted and end."""

    enabled = True

    def __init__(self) -> None:
        super().__init__()
        cache = make_prefix_cache(
            num_blocks=POOL,
            block_size=BS,
            enabled=self.enabled,
            eviction_policy="lru",
            session_ttl=0.0,
            namespace_quota=None,
            refetch_window=60.0,
            tier_blocks=0,
            mover=None,
        )
        self.kv = KVCacheManager(cache, _copy_block)
        self.running: list[Request] = []
        self.next_id = 0

    def new_request(self, tokens: list[int], namespace: Hashable) -> Request:
        self.next_id += 1
        detokenizer: Any = None  # the manager never reads text
        return Request(f"r{self.next_id}", tokens, None, None, detokenizer, namespace)  # type: ignore[arg-type]

    @precondition(lambda self: len(self.running) < MAX_RUNNING)
    @rule(tokens=tokens_st, namespace=namespace_st, chunk=st.integers(1, 8))
    def admit(self, tokens: list[int], namespace: Hashable, chunk: int) -> None:
        req = self.new_request(tokens, namespace)
        peeked = self.kv.peek(req)
        cached = self.kv.admit(req)
        assert cached < len(tokens)  # the last token is always computed
        if not self.enabled:
            assert peeked == cached == 0
        n = min(chunk, len(req.token_ids) - req.num_computed)
        if not self.kv.ensure_blocks(req, req.num_computed + n):
            self.kv.release(req, cache_computed=False)
            assert (req.block_table, req.lock_node, req.num_computed) == ([], None, 0)
            return
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 8), token=st.integers(0, 2))
    def compute(self, data: st.DataObject, chunk: int, token: int) -> None:
        """One step of one request: a prefill chunk, or a decode that samples `token`."""
        req = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        if req.num_computed == len(req.token_ids):
            req.token_ids.append(token)
        n = min(chunk, len(req.token_ids) - req.num_computed)
        if not self.kv.ensure_blocks(req, req.num_computed + n):
            self.running.remove(req)  # preempted: what it computed stays cached
            self.kv.release(req, cache_computed=True)
            return
        self.kv.commit(req, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), cache_computed=st.booleans())
    def finish(self, data: st.DataObject, cache_computed: bool) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.kv.release(req, cache_computed)
        assert (req.block_table, req.lock_node, req.num_computed) == ([], None, 0)

    @invariant()
    def every_block_in_one_place(self) -> None:
        self.kv.check_invariants()
        private = 0
        for req in self.running:
            assert len(req.block_table) * BS >= req.num_computed
            private += len(req.block_table) - req.num_shared_blocks
        assert self.kv.num_private_blocks == private
        stats = self.kv.cache.stats()
        assert self.kv.pool.num_free + stats.cached_blocks + private == POOL
        if not self.enabled:
            assert stats.cached_blocks == stats.num_nodes == self.kv.prefix_cache_hits == 0
            assert all(req.num_shared_blocks == 0 for req in self.running)
            assert self.kv.num_available() == self.kv.pool.num_free

    def teardown(self) -> None:
        while self.running:
            self.kv.release(self.running.pop())
        assert self.kv.num_private_blocks == 0
        assert self.kv.cache.stats().locked_blocks == 0
        if not self.enabled:
            assert self.kv.pool.num_free == POOL


class NullManagerMachine(ManagerMachine):
    """The same sequences with the cache off."""

    enabled = False


for machine in (ManagerMachine, NullManagerMachine):
    machine.TestCase.settings = settings(
        max_examples=100,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
test_manager_keeps_every_block_in_one_place = ManagerMachine.TestCase
test_manager_with_the_cache_off_keeps_every_block_private = NullManagerMachine.TestCase
