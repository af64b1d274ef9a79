"""RadixRequestRouter's ranking and mirror bookkeeping, without a Ray cluster."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from radixserve.engine.params import SamplingParams  # noqa: E402
from radixserve.ray.bridge import EngineCall  # noqa: E402
from radixserve.ray.events import ReplicaUpdate, stop_following  # noqa: E402
from radixserve.ray.router import RadixRequestRouter  # noqa: E402

DEP = DeploymentID(name="RadixEngine", app_name="test")
CHAT = list(range(100, 164))  # 64 tokens, 4 blocks of 16


def replica(uid: str) -> Any:
    return SimpleNamespace(replica_id=ReplicaID(uid, DEP), max_ongoing_requests=64)


def request(tokens: list[int]) -> Any:
    return SimpleNamespace(args=[EngineCall(tokens, SamplingParams(), "r")], kwargs={})


async def make_router() -> RadixRequestRouter:
    r = RadixRequestRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state()
    r._follower = asyncio.get_running_loop().create_future()  # no event log in these tests
    return r


def cached(r: RadixRequestRouter, rep: Any, tokens: list[int], seq: int = 1) -> None:
    upd = ReplicaUpdate(seq, 16, 100, snapshot=[(None, tuple(tokens))])
    r.apply_update(rep.replica_id.to_full_id_str(), upd)


def test_the_replica_holding_the_prompt_ranks_first() -> None:
    async def go() -> None:
        r = await make_router()
        a, b = replica("a"), replica("b")
        cached(r, b, CHAT[:48])
        ranks = await r.choose_replicas([a, b], request(CHAT + [7, 8, 9]))
        assert [g[0] for g in ranks] == [b, a]
        assert r.decisions["cache_hit"] == 1

    asyncio.run(go())


def test_without_a_useful_prefix_the_shorter_queue_wins() -> None:
    async def go() -> None:
        r = await make_router()
        a, b = replica("a"), replica("b")
        r.replica_queue_len_cache.update(a.replica_id, 3)
        r.replica_queue_len_cache.update(b.replica_id, 1)
        ranks = await r.choose_replicas([a, b], request(CHAT))
        assert ranks[0] == [b]

    asyncio.run(go())


def test_an_overloaded_replica_loses_its_cache_advantage() -> None:
    async def go() -> None:
        r = await make_router()
        a, b = replica("a"), replica("b")
        cached(r, a, CHAT)
        r.replica_queue_len_cache.update(a.replica_id, 20)
        r.replica_queue_len_cache.update(b.replica_id, 0)
        ranks = await r.choose_replicas([a, b], request(CHAT))
        assert ranks[0] == [b] and r.decisions["load_imbalance"] == 1

    asyncio.run(go())


def test_a_dead_replicas_trie_is_dropped_and_its_events_ignored() -> None:
    async def go() -> None:
        r = await make_router()
        a = replica("a")
        cached(r, a, CHAT)
        name = a.replica_id.to_full_id_str()
        r.on_replica_actor_died(a.replica_id)
        assert name not in r.tries
        assert name in r._gone

    asyncio.run(go())


def test_calls_other_than_generation_go_to_any_replica() -> None:
    async def go() -> None:
        r = await make_router()
        a, b = replica("a"), replica("b")
        info = SimpleNamespace(args=[], kwargs={})
        (rank,) = await r.choose_replicas([a, b], info)
        assert sorted(rank, key=id) == sorted([a, b], key=id)

    asyncio.run(go())


class FlakyLog:
    """An event log whose pulls fail `failures` times, then return one replica's update."""

    def __init__(self, failures: int, error: Exception) -> None:
        self.failures, self.error = failures, error
        self.pull = SimpleNamespace(remote=self._pull)

    async def _pull(self, epoch: str | None, cursors: dict[str, int], timeout: float) -> Any:
        if self.failures:
            self.failures -= 1
            raise self.error
        await asyncio.sleep(0)
        return "epoch-1", {"a": ReplicaUpdate(1, 16, 100, snapshot=[(None, tuple(CHAT))])}


def test_failed_pulls_are_retried_while_ray_runs_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("radixserve.ray.router.ray.is_initialized", lambda: True)
    caplog.set_level(logging.INFO, logger="radixserve.ray.router")

    async def go() -> None:
        r = await make_router()
        r._log = FlakyLog(2, RuntimeError("log actor restarting"))
        task = asyncio.create_task(r._follow())
        for _ in range(100):  # a retry every half second
            await asyncio.sleep(0.05)
            if "a" in r.tries:
                break
        task.cancel()
        assert "a" in r.tries and r._epoch == "epoch-1"

    asyncio.run(go())
    assert caplog.text.count("cannot pull cache events") == 1
    assert "cache events pulled again" in caplog.text


def test_the_follower_stops_quietly_once_ray_has_shut_down(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("radixserve.ray.router.ray.is_initialized", lambda: False)

    log_ = FlakyLog(1, AttributeError("'Worker' object has no attribute 'core_worker'"))

    async def go() -> None:
        r = await make_router()
        r._log = log_
        await asyncio.wait_for(r._follow(), timeout=5)

    asyncio.run(go())
    assert "cannot pull cache events" not in caplog.text
    # No pull was even tried: one would start a fresh local Ray instance (auto-connect).
    assert log_.failures == 1


class SlowLog:
    """An event log whose pulls each take `seconds`, counting pulls started and returned."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started, self.returned = seconds, 0, 0
        self.pull = SimpleNamespace(remote=self._pull)

    async def _pull(self, epoch: str | None, cursors: dict[str, int], timeout: float) -> Any:
        self.started += 1
        await asyncio.sleep(self.seconds)
        self.returned += 1
        return "epoch-1", {}


def test_stop_following_waits_for_the_pull_in_flight_and_the_follower_stays_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("radixserve.ray.router.ray.is_initialized", lambda: True)
    # As in a driver holding a handle: the router lives on Serve's loop in another thread.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        log_ = SlowLog(0.3)

        async def start() -> RadixRequestRouter:
            r = await make_router()
            r._log = log_
            r._follower = asyncio.create_task(r._follow())
            return r

        r = asyncio.run_coroutine_threadsafe(start(), loop).result(5)
        for _ in range(500):
            if log_.started:
                break
            threading.Event().wait(0.01)
        assert stop_following(timeout_s=5) == 1
        assert r._follower is not None and r._follower.done()
        assert log_.returned == log_.started >= 1  # the last pull returned, not cancelled
        a, b = replica("a"), replica("b")
        asyncio.run_coroutine_threadsafe(r.choose_replicas([a, b], request(CHAT)), loop).result(5)
        threading.Event().wait(0.5)
        assert r._follower.done() and log_.started == log_.returned  # no new pull began
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
