"""RadixRequestRouter's ranking and mirror bookkeeping, without a Ray cluster."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from radixserve.engine.params import SamplingParams  # noqa: E402
from radixserve.ray.bridge import EngineCall  # noqa: E402
from radixserve.ray.events import ReplicaUpdate  # noqa: E402
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
