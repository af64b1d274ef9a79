"""`RadixRequestRouter`: Ray Serve request routing by each replica's real prefix cache.

Ranks the engine replicas with the standalone router's policy (`radixserve.router.policy`),
over one token-level mirror trie per replica kept exact from that replica's cache events
(see `radixserve.ray.events`: replicas push to a log actor, this router long-polls it), with
each replica's load taken from Ray's own queue-length cache. A replica that dies or leaves
loses its trie; a new one starts empty and fills from its events.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from typing import Any

import ray
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.ray.bridge import EngineCall
from radixserve.ray.events import ReplicaUpdate, add_follower, apply, get_event_log, new_mirror
from radixserve.router.policy import PolicyConfig, WorkerView, rank_cache_aware
from radixserve.router.trie import WorkerTrie

log = logging.getLogger(__name__)


class RadixRequestRouter(RequestRouter):
    """Routes each request to the replica whose cache holds most of its prompt, load allowing."""

    def initialize_state(
        self,
        cache_threshold: float = PolicyConfig.cache_threshold,
        balance_abs_threshold: int = PolicyConfig.balance_abs_threshold,
        balance_rel_threshold: float = PolicyConfig.balance_rel_threshold,
        poll_timeout_s: float = 1.0,
    ) -> None:
        """Set the policy's thresholds (Serve passes `request_router_kwargs` here)."""
        self.policy_cfg = PolicyConfig(
            cache_threshold, balance_abs_threshold, balance_rel_threshold
        )
        self.poll_timeout_s = poll_timeout_s
        self.tries: dict[str, WorkerTrie] = {}
        self.pool_blocks: dict[str, int] = {}
        self.decisions: collections.Counter[str] = collections.Counter()
        self._cursors: dict[str, int] = {}
        self._gone: set[str] = set()
        self._epoch: str | None = None
        self._log: Any = None
        self._follower: asyncio.Task[None] | None = None
        self._stopped = False
        add_follower(self, self._event_loop)
        # Follow from the start, not from the first request: the mirrors must be warm by the
        # time a conversation's second turn arrives.
        self._event_loop.call_soon_threadsafe(self._follow_events)

    # ---- the mirrors -----------------------------------------------------------------------
    def _follow_events(self) -> None:
        """Start (or restart) the task that keeps the mirrors up to date, on this loop."""
        if self._stopped:
            return
        if self._follower is None or self._follower.done():
            d = self._deployment_id
            self._log = get_event_log(d.app_name, d.name)
            self._follower = asyncio.get_running_loop().create_task(self._follow())

    async def _follow(self) -> None:
        failing = False  # one warning an outage, not one a retry
        while not self._stopped:
            if not ray.is_initialized():  # Ray has shut down: a pull would start a new instance
                return
            try:
                epoch, updates = await self._log.pull.remote(
                    self._epoch, dict(self._cursors), self.poll_timeout_s
                )
            except Exception as e:
                if not ray.is_initialized():  # this process's Ray has shut down: nothing to follow
                    return
                if not failing:
                    log.warning("cannot pull cache events, retrying every 0.5 s: %r", e)
                    failing = True
                self._epoch = None  # the log may be restarting: the next pull snapshots all
                await asyncio.sleep(0.5)
                continue
            if failing:
                log.info("cache events pulled again")
                failing = False
            if epoch != self._epoch:
                self._epoch = epoch
                self._cursors.clear()
            for replica, upd in updates.items():
                if replica not in self._gone:
                    self.apply_update(replica, upd)

    async def stop_following(self) -> None:
        """Stop following the log, once the pull in flight (if any) has returned."""
        self._stopped = True
        task = self._follower
        if task is None or task.done():
            return
        try:  # a pull returns within its poll timeout: wait rather than leave it dangling
            await asyncio.wait_for(asyncio.shield(task), self.poll_timeout_s + 5)
        except Exception:
            task.cancel()

    def apply_update(self, replica: str, upd: ReplicaUpdate) -> None:
        """Bring one replica's mirror up to `upd.seq`."""
        trie = self.tries.get(replica)
        if upd.snapshot is not None or trie is None:
            trie = self.tries[replica] = new_mirror(upd.block_size, upd.num_blocks)
            trie.load(upd.snapshot or [])
        for ev in upd.events:
            apply(trie, ev)
        self.pool_blocks[replica] = upd.num_blocks
        self._cursors[replica] = upd.seq

    def drop(self, replica_id: ReplicaID) -> None:
        """Forget a dead or removed replica's mirror (and tell the log)."""
        name = replica_id.to_full_id_str()
        self._gone.add(name)
        self.tries.pop(name, None)
        self.pool_blocks.pop(name, None)
        self._cursors.pop(name, None)
        if self._log is not None:
            self._log.forget.remote([name])

    # ---- Ray's hooks -------------------------------------------------------------------------
    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Ray saw the replica die: stop routing there and drop its trie."""
        super().on_replica_actor_died(replica_id)
        self.drop(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """The deployment's replica set changed: drop the tries of replicas that left."""
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        for rid in before - set(self._replica_id_set):
            self.drop(rid)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Every candidate in the cache-aware policy's order, one per rank."""
        self._follow_events()
        call = _engine_call(pending_request)
        if call is None or len(candidate_replicas) < 2:
            # Not a generation call: any replica, least queued, ties broken at random (Ray
            # takes the first of equals, which would always be the same replica).
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        views = []
        for i, r in enumerate(candidate_replicas):
            name = r.replica_id.to_full_id_str()
            trie = self.tries.get(name)
            queued = self._replica_queue_len_cache.get(r.replica_id)
            ids, ns = call.prompt_token_ids, call.namespace
            matched = trie.match(ids, ns) if trie else 0
            views.append(
                WorkerView(
                    index=i,
                    in_flight=queued or 0,
                    matched_tokens=matched,
                    continues=bool(trie and trie.continues(ids, ns, matched)),
                    cached_blocks=trie.num_blocks if trie else 0,
                    total_blocks=self.pool_blocks.get(name, 0),
                )
            )
        ranked = rank_cache_aware(views, len(call.prompt_token_ids), self.policy_cfg)
        self.decisions[ranked[0].reason] += 1
        return [[candidate_replicas[d.index]] for d in ranked]


def _engine_call(pending: PendingRequest | None) -> EngineCall | None:
    if pending is None:
        return None
    for arg in pending.args:
        if isinstance(arg, EngineCall):
            return arg
    return None
