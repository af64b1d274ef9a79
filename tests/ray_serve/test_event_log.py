"""The cache event log between engine replicas and request routers (no Ray cluster needed)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

from radixserve.ray import events  # noqa: E402
from radixserve.ray.events import CacheEventLog, Event, apply, new_mirror  # noqa: E402
from radixserve.router.trie import WorkerTrie  # noqa: E402

BS = 4
GEOMETRY = (BS, 32)
A = tuple(range(1, 13))  # three blocks
B = (*A[:4], 90, 91, 92, 93)  # shares A's first block


def ins(tokens: tuple[int, ...]) -> Event:
    return ("insert", None, tokens, len(tokens))


def ev(tokens: tuple[int, ...], n: int) -> Event:
    return ("evict", None, tokens, n)


def replay(updates: dict, tries: dict) -> dict[str, int]:
    cursors = {}
    for r, upd in updates.items():
        if upd.snapshot is not None or r not in tries:
            tries[r] = new_mirror(upd.block_size, upd.num_blocks)
            tries[r].load(upd.snapshot or [])
        for e in upd.events:
            apply(tries[r], e)
        cursors[r] = upd.seq
    return cursors


def source_paths(evs: list[Event]) -> list:
    m = new_mirror(*GEOMETRY)
    for e in evs:
        apply(m, e)
    return sorted(m.paths())


def test_a_follower_replays_exactly_what_the_replica_cached() -> None:
    async def go() -> None:
        log = CacheEventLog()
        first = [ins(A), ins(B)]
        assert await log.push("r1", 0, first, GEOMETRY)
        epoch, ups = await log.pull(None, {}, timeout=0)
        tries: dict = {}
        cursors = replay(ups, tries)
        assert cursors == {"r1": 2} and ups["r1"].snapshot is not None
        more = [ev(A, 8), ins((*A[:8], 7, 7, 7, 7))]
        assert await log.push("r1", 2, more, GEOMETRY)
        _, ups = await log.pull(epoch, cursors, timeout=0)
        assert ups["r1"].snapshot is None and ups["r1"].events == more  # only the new ones
        replay(ups, tries)
        assert sorted(tries["r1"].paths()) == source_paths(first + more)

    asyncio.run(go())


def test_a_batch_out_of_sequence_is_refused_until_a_snapshot() -> None:
    async def go() -> None:
        log = CacheEventLog()
        assert not await log.push("r1", 5, [ins(A)], GEOMETRY)  # log never saw events 0..4
        await log.push_snapshot("r1", 6, [(None, A)], GEOMETRY)
        assert await log.push("r1", 6, [ins(B)], GEOMETRY)
        _, ups = await log.pull(None, {}, timeout=0)
        assert ups["r1"].seq == 7
        assert sorted(replay_one(ups["r1"]).paths()) == source_paths([ins(A), ins(B)])

    asyncio.run(go())


def replay_one(upd: events.ReplicaUpdate) -> WorkerTrie:
    tries: dict[str, WorkerTrie] = {}
    replay({"x": upd}, tries)
    return tries["x"]


def test_a_follower_behind_the_kept_tail_gets_a_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_LOG_EVENTS", 2)

    async def go() -> None:
        log = CacheEventLog()
        evs = [ins(A), ins(B), ev(B, 4), ins((5, 5, 5, 5))]
        assert await log.push("r1", 0, evs, GEOMETRY)
        _, ups = await log.pull(log.epoch, {"r1": 1}, timeout=0)
        assert ups["r1"].snapshot is not None  # events 1.. are no longer all kept
        assert sorted(replay_one(ups["r1"]).paths()) == source_paths(evs)

    asyncio.run(go())


def test_pull_waits_for_news_and_a_new_epoch_resets_cursors() -> None:
    async def go() -> None:
        log = CacheEventLog()
        await log.push("r1", 0, [ins(A)], GEOMETRY)
        epoch, _ = await log.pull(None, {}, timeout=0)
        waiter = asyncio.create_task(log.pull(epoch, {"r1": 1}, timeout=5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await log.push("r1", 1, [ins(B)], GEOMETRY)
        _, ups = await asyncio.wait_for(waiter, 1)
        assert ups["r1"].events == [ins(B)]
        _, ups = await log.pull("another-epoch", {"r1": 2}, timeout=0)
        assert ups["r1"].snapshot is not None

    asyncio.run(go())


def test_forgotten_replicas_are_no_longer_reported() -> None:
    async def go() -> None:
        log = CacheEventLog()
        await log.push("r1", 0, [ins(A)], GEOMETRY, stats={"num_running": 1})
        await log.push("r2", 0, [ins(B)], GEOMETRY)
        assert set(await log.replica_stats()) == {"r1"}
        await log.forget(["r1"])
        _, ups = await log.pull(None, {}, timeout=0)
        assert set(ups) == {"r2"}

    asyncio.run(go())
