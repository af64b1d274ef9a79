"""Cache events from engine replicas to the request routers, through one small Ray actor.

Replicas push, routers pull. Each engine replica numbers its cache events from 0 (its cache
starts empty, and the listener is attached before the engine starts, so event 0 is the first
change) and pushes them in batches to the deployment's `CacheEventLog` actor. Every request
router (one per process holding a handle: the ingress replicas, Serve's proxies) long-polls
that log with one cursor per replica and replays the events on its own mirror tries, so a
routing decision reads local memory only.

Why push to a log rather than have routers pull from the replicas: Ray Serve gives a router no
channel to one particular replica's user methods except routing a request there (which would
occupy a slot and count in the queue lengths the router balances on), and there may be many
routers (one per proxy and ingress replica). A replica pushes once; any number of routers read.
The log keeps a bounded tail of events plus an exact mirror per replica, so a router that
falls behind, or starts late, gets a snapshot and then the events after it: the tries stay
exact. If the log actor itself restarts (empty), replicas see it refuse their next batch and
resend a snapshot of their own mirror.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.cache import CacheEvent
from radixserve.router.trie import WorkerTrie

if TYPE_CHECKING:
    from radixserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)

LOG_NAME = "radixserve-cache-events"
# Events kept per replica for routers that are behind; older cursors get a snapshot.
MAX_LOG_EVENTS = 50_000
# Slack on top of the replica's pool in the mirrors (events of one step may arrive together).
MIRROR_SLACK_BLOCKS = 64

Event = tuple[str, Hashable, tuple[int, ...], int]  # (kind, namespace, token ids, num_tokens)
Path = tuple[Hashable, tuple[int, ...]]


def log_namespace(app_name: str, deployment: str) -> str:
    """The Ray namespace of a deployment's event log (one log per engine deployment)."""
    return f"serve::{app_name}::{deployment}::radixserve"


def apply(trie: WorkerTrie, event: Event) -> None:
    """Replay one event on a mirror."""
    kind, namespace, token_ids, num_tokens = event
    if kind == "insert":
        trie.insert(token_ids, namespace)
    else:
        trie.remove(token_ids, namespace, num_tokens)


@dataclass
class ReplicaUpdate:
    """What a router learns about one replica from one pull."""

    seq: int  # events applied once this update is
    block_size: int
    num_blocks: int
    snapshot: list[Path] | None = None  # replace the mirror with these paths first
    events: list[Event] = field(default_factory=list)


@dataclass
class _ReplicaLog:
    block_size: int
    num_blocks: int
    mirror: WorkerTrie
    seq: int = 0
    tail: collections.deque[Event] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_LOG_EVENTS)
    )
    stats: dict[str, Any] = field(default_factory=dict)
    pushed_at: float = field(default_factory=time.monotonic)

    @property
    def base(self) -> int:  # the seq of the oldest event still in the tail
        return self.seq - len(self.tail)


class CacheEventLog:
    """The Ray actor between replicas (push) and routers (long-poll). Async: calls interleave."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex  # changes if the actor restarts (its state is gone)
        self._replicas: dict[str, _ReplicaLog] = {}
        self._changed = asyncio.Event()

    async def push(
        self,
        replica: str,
        first_seq: int,
        events: list[Event],
        geometry: tuple[int, int],
        stats: dict[str, Any] | None = None,
    ) -> bool:
        """Append a replica's events numbered from `first_seq`; False: send a snapshot first."""
        rec = self._replicas.get(replica)
        if rec is None and first_seq == 0:
            rec = self._replicas[replica] = _new_log(*geometry)
        if rec is None or rec.seq != first_seq:
            return False
        for ev in events:
            apply(rec.mirror, ev)
            rec.tail.append(ev)
        rec.seq += len(events)
        rec.pushed_at = time.monotonic()
        if stats is not None:
            rec.stats = stats
        if events:
            self._wake()
        return True

    async def push_snapshot(
        self, replica: str, seq: int, paths: list[Path], geometry: tuple[int, int]
    ) -> None:
        """Replace what is known of a replica with its own mirror as of event `seq`."""
        rec = self._replicas[replica] = _new_log(*geometry)
        rec.mirror.load(paths)
        rec.seq = seq
        self._wake()

    async def pull(
        self, epoch: str | None, cursors: dict[str, int], timeout: float = 1.0
    ) -> tuple[str, dict[str, ReplicaUpdate]]:
        """Updates for every replica past its cursor, waiting up to `timeout` s for one.

        A cursor that is missing, from another epoch, or older than the kept tail gets a
        snapshot. Returns this log's epoch and the updates.
        """
        if epoch != self.epoch:
            cursors = {}
        updates = self._updates(cursors)
        if not updates:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
            updates = self._updates(cursors)
        return self.epoch, updates

    async def forget(self, replicas: list[str]) -> None:
        """Drop dead replicas' logs."""
        for r in replicas:
            self._replicas.pop(r, None)

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        """The latest engine stats each live replica pushed (for the ingress' /metrics)."""
        return {r: rec.stats for r, rec in self._replicas.items() if rec.stats}

    def _updates(self, cursors: dict[str, int]) -> dict[str, ReplicaUpdate]:
        out = {}
        for r, rec in self._replicas.items():
            cur = cursors.get(r)
            if cur == rec.seq:
                continue
            upd = ReplicaUpdate(rec.seq, rec.block_size, rec.num_blocks)
            if cur is None or cur < rec.base or cur > rec.seq:
                upd.snapshot = rec.mirror.paths()
            else:
                upd.events = list(rec.tail)[cur - rec.base :]
            out[r] = upd
        return out

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _new_log(block_size: int, num_blocks: int) -> _ReplicaLog:
    return _ReplicaLog(block_size, num_blocks, new_mirror(block_size, num_blocks))


def new_mirror(block_size: int, num_blocks: int) -> WorkerTrie:
    """An empty mirror of a replica whose pool has `num_blocks` blocks."""
    return WorkerTrie(block_size, num_blocks + MIRROR_SLACK_BLOCKS)


def get_event_log(app_name: str, deployment: str) -> Any:
    """The deployment's event log actor, created (detached, 0 CPUs) if it does not exist yet.

    Like Ray's own PrefixCacheAffinityRouter tree actor, it is registered with the Serve
    controller so that `serve.shutdown()` removes it.
    """
    import ray

    actor_cls = ray.remote(num_cpus=0, max_restarts=-1)(CacheEventLog)
    handle = actor_cls.options(
        name=LOG_NAME,
        namespace=log_namespace(app_name, deployment),
        get_if_exists=True,
        lifetime="detached",
    ).remote()
    with contextlib.suppress(Exception):  # a private hook; without it `ray stop` still cleans up
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        controller._register_shutdown_cleanup_actor.remote(handle)
    return handle


# The routers of this process that follow a log, with the loop each runs on. Kept here and not
# in the router's module: Serve pickles a custom router's module by value, so each process's
# router class has module globals of its own, while this module is imported by reference.
_followers: weakref.WeakKeyDictionary[Any, asyncio.AbstractEventLoop] = weakref.WeakKeyDictionary()


def add_follower(router: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Record a router that follows a log on `loop`; `await router.stop_following()` on that
    loop ends its following."""
    _followers[router] = loop


def stop_following(timeout_s: float = 10.0) -> int:
    """Stop every router of this process from following its log; how many were stopped.

    A driver holding a handle to the engine deployment runs a router on Serve's loop thread.
    Call this before `ray.shutdown()`, from another thread: a pull that outlives Ray either
    starts a new local Ray instance (Ray connects automatically on first use) or, at exit,
    makes Ray end the whole process with status 1.
    """
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    stopped = 0
    for router, loop in list(_followers.items()):
        if loop.is_closed() or not loop.is_running():
            continue
        if loop is here:
            raise RuntimeError("stop_following() would wait on the loop it runs on")
        asyncio.run_coroutine_threadsafe(router.stop_following(), loop).result(timeout_s)
        stopped += 1
    _followers.clear()
    return stopped


class EventPublisher:
    """Runs in an engine replica: numbers its cache events and pushes them to the log.

    Attach it before `engine.start()`: the replica's cache is empty then, so its own mirror
    (kept to answer a restarted log with a snapshot) and its numbering start exact. Pushing
    happens on a daemon thread, one batch in flight at a time; engine stats ride along at
    most once a second.
    """

    def __init__(self, engine: LLMEngine, replica: str, event_log: Any) -> None:
        self.engine = engine
        self.replica = replica
        self.log = event_log
        self.geometry = (engine.block_size, engine.num_blocks)
        self.mirror = new_mirror(engine.block_size, engine.num_blocks)
        self.seq = 0  # events pushed and accepted
        self._pending: list[Event] = []
        self._cond = threading.Condition()
        self._stop = False
        engine.add_cache_listener(self._on_event)
        self._thread = threading.Thread(target=self._run, name="radixserve-events", daemon=True)
        self._thread.start()

    def _on_event(self, event: CacheEvent) -> None:  # engine thread: quick, never raises
        ev: Event = (str(event.kind), event.namespace, tuple(event.token_ids), event.num_tokens)
        with self._cond:
            self._pending.append(ev)
            self._cond.notify()

    def close(self) -> None:
        """Stop pushing (the replica is shutting down)."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _run(self) -> None:
        import ray

        last_stats = 0.0
        while True:
            with self._cond:
                if not self._pending and not self._stop:
                    self._cond.wait(1.0)
                if self._stop:
                    return
                batch, self._pending = self._pending, []
            stats = None
            if time.monotonic() - last_stats >= 1.0:
                stats, last_stats = _stats_dict(self.engine), time.monotonic()
            if not batch and stats is None:
                continue
            try:
                ok = ray.get(
                    self.log.push.remote(self.replica, self.seq, batch, self.geometry, stats)
                )
                for ev in batch:
                    apply(self.mirror, ev)
                if not ok:  # the log restarted or never saw us: a snapshot makes it exact again
                    seq, paths = self.seq + len(batch), self.mirror.paths()
                    ray.get(self.log.push_snapshot.remote(self.replica, seq, paths, self.geometry))
                self.seq += len(batch)
            except Exception as e:  # the log is restarting: keep the batch, try again soon
                log.warning("cannot push cache events: %r", e)
                with self._cond:
                    self._pending = batch + self._pending
                time.sleep(0.5)


def _stats_dict(engine: LLMEngine) -> dict[str, Any]:
    return dataclasses.asdict(engine.stats())
