"""The router's mirror of a worker fed by vLLM-format block events, and its ZMQ subscriber:
replay on connect, after a gap, and a restarted publisher."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from radixserve.cache import BlockPool, RadixCache
from radixserve.router.kv_mirror import BlockMirror, BlockSizeMismatch
from radixserve.router.kv_subscriber import KVEventSource, KVEventSubscriber
from radixserve.router.trie import WorkerTrie
from radixserve.server.kv_events.config import KVEventsConfig
from radixserve.server.kv_events.hashing import path_hashes
from radixserve.server.kv_events.publisher import KVEventPublisher
from radixserve.server.kv_events.translate import EventTranslator
from radixserve.server.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from tests.support import free_port

BS = 4
A, B, C = [1] * BS, [2] * BS, [3] * BS


def stored(tokens: list[int], first: int = 0, medium: str = "GPU", salt: str | None = None):
    """A BlockStored of the path `tokens`' blocks from block `first` on."""
    h = path_hashes(tokens, BS, salt)
    extra = [(salt,) if first + i == 0 else None for i in range(len(h) - first)] if salt else None
    return BlockStored(
        h[first:], h[first - 1] if first else None, tokens[first * BS :], BS, None, medium, None,
        extra_keys=extra,
    )  # fmt: skip


def removed(tokens: list[int], block: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved([path_hashes(tokens, BS)[block]], medium)


def mirror() -> BlockMirror:
    return BlockMirror(WorkerTrie(BS, 1024))


def paths(m: BlockMirror) -> set[tuple[object, tuple[int, ...]]]:
    return set(m.trie.paths())


def test_stored_blocks_become_a_path_with_the_first_blocks_salt_as_namespace() -> None:
    m = mirror()
    m.apply(stored(A + B, salt="tenant"))
    m.apply(stored(A + B + C, first=2, salt="tenant"))
    assert paths(m) == {("tenant", tuple(A + B + C))}
    assert m.trie.match(A + B + C, "tenant") == 12 and m.trie.match(A + B, None) == 0


def test_removing_a_block_unreaches_everything_below_it() -> None:
    m = mirror()
    m.apply(stored(A + B + C))
    m.apply(removed(A + B + C, 1))
    assert paths(m) == {(None, tuple(A))}


def test_a_parent_stored_again_brings_back_its_cached_children() -> None:
    m = mirror()
    m.apply(stored(A + B + C))
    m.apply(removed(A + B + C, 0))  # vLLM evicts block by block: B and C stay cached
    assert paths(m) == set()
    m.apply(stored(A))
    assert paths(m) == {(None, tuple(A + B + C))}


def test_a_block_stored_before_its_parent_waits_for_it() -> None:
    m = mirror()
    m.apply(stored(A + B, first=1))  # a subscriber that joined late
    assert paths(m) == set()
    m.apply(stored(A))
    assert paths(m) == {(None, tuple(A + B))}


def test_a_block_stays_while_any_medium_holds_it() -> None:
    m = mirror()
    m.apply(stored(A + B))
    m.apply(stored(A + B, first=1, medium="CPU"))
    m.apply(removed(A + B, 1, "GPU"))
    assert paths(m) == {(None, tuple(A + B))}
    m.apply(removed(A + B, 1, "CPU"))
    assert paths(m) == {(None, tuple(A))}


def test_repeated_stores_and_unknown_removals_change_nothing() -> None:
    m = mirror()
    for _ in range(3):
        m.apply(stored(A + B))
    m.apply(removed(C + C, 0))
    assert paths(m) == {(None, tuple(A + B))}
    assert len(m.blocks) == 2


def test_all_blocks_cleared_empties_the_mirror() -> None:
    m = mirror()
    m.apply(stored(A + B))
    m.apply(AllBlocksCleared())
    assert paths(m) == set() and m.blocks == {}


def test_blocks_of_another_size_are_refused() -> None:
    m = BlockMirror(WorkerTrie(16, 64))
    with pytest.raises(BlockSizeMismatch, match="--block-size 4"):
        m.apply(stored(A))


def test_worker_kv_events_text_is_endpoint_and_optional_replay() -> None:
    assert KVEventSource.parse("tcp://h:1,tcp://h:2") == KVEventSource("tcp://h:1", "tcp://h:2")
    assert KVEventSource.parse("tcp://h:1") == KVEventSource("tcp://h:1", None)
    with pytest.raises(ValueError, match="ENDPOINT"):
        KVEventSource.parse("http://h:1")


class ScriptedPublisher:
    """A PUB and a ROUTER socket the test drives by hand (sequence numbers of its choosing)."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.router.bind(self.replay_endpoint)
        self.kept: dict[int, bytes] = {}
        self.requests: list[int] = []

    def batch(self, seq: int, *events: object, live: bool = True) -> None:
        payload = encode_batch(KVEventBatch(0.0, list(events), 0))  # type: ignore[arg-type]
        self.kept[seq] = payload
        if live:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def answer_replays(self) -> None:
        while self.router.poll(0):
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            for seq in sorted(s for s in self.kept if s >= first):
                frames = [client, b"", b"", seq.to_bytes(8, "big"), self.kept[seq]]
                self.router.send_multipart(frames)
            self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


async def follow(pub: ScriptedPublisher, script: object) -> tuple[BlockMirror, KVEventSubscriber]:
    """Run a subscriber against `pub` while `script(pub, sub)` (a coroutine) drives it."""
    m = mirror()

    def on_batch(seq: int, batch: KVEventBatch) -> None:
        for event in batch.events:
            m.apply(event)

    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, on_batch, m.clear)

    async def serve_replays() -> None:
        while True:
            pub.answer_replays()
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(sub.run()), asyncio.create_task(serve_replays())]
    try:
        await asyncio.wait_for(sub.synced.wait(), 10)
        await asyncio.wait_for(script(pub, sub), 20)  # type: ignore[operator]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sub.close()
    return m, sub


async def until(predicate: object, what: str) -> None:
    while not predicate():  # type: ignore[operator]
        await asyncio.sleep(0.02)


async def heard_live(pub: ScriptedPublisher, sub: KVEventSubscriber, seq: int) -> None:
    """Publish a no-op batch `seq` until the subscriber has applied it (the SUB socket hears
    nothing until its subscription reached the publisher)."""
    while sub.last is None or sub.last < seq:
        pub.batch(seq)
        await asyncio.sleep(0.05)


def test_subscriber_replays_from_zero_on_connect() -> None:
    pub = ScriptedPublisher()
    pub.batch(0, stored(A), live=False)
    pub.batch(1, stored(A + B, first=1), live=False)

    async def script(pub: ScriptedPublisher, sub: KVEventSubscriber) -> None:
        pass

    try:
        m, sub = asyncio.run(follow(pub, script))
    finally:
        pub.close()
    assert pub.requests[0] == 0
    assert paths(m) == {(None, tuple(A + B))} and sub.last == 1


def test_a_gap_in_the_sequence_is_filled_by_a_replay() -> None:
    pub = ScriptedPublisher()
    pub.batch(0, live=False)

    async def script(pub: ScriptedPublisher, sub: KVEventSubscriber) -> None:
        await heard_live(pub, sub, 1)
        pub.batch(2, stored(A), live=False)  # lost on the way
        pub.batch(3, stored(A + B, first=1))
        await until(lambda: sub.last == 3, "batch 3")

    try:
        m, sub = asyncio.run(follow(pub, script))
    finally:
        pub.close()
    assert 2 in pub.requests
    assert sub.stats.gaps == 1 and sub.stats.lost == 0
    assert paths(m) == {(None, tuple(A + B))}


def test_a_restarted_publisher_clears_the_mirror_and_replays() -> None:
    pub = ScriptedPublisher()
    pub.batch(0, stored(A), live=False)

    async def script(pub: ScriptedPublisher, sub: KVEventSubscriber) -> None:
        await heard_live(pub, sub, 5)
        pub.kept.clear()  # a new process: numbering starts again
        pub.batch(0, stored(C), live=False)
        pub.batch(1, stored(C + B, first=1))
        await until(lambda: sub.stats.restarts == 1 and sub.last == 1, "the restart")

    try:
        m, sub = asyncio.run(follow(pub, script))
    finally:
        pub.close()
    assert paths(m) == {(None, tuple(C + B))}


def test_subscriber_mirrors_a_real_publisher_exactly() -> None:
    cache = RadixCache(BlockPool(8), BS)
    cache.insert(A + B, cache.allocate(2))
    cfg = KVEventsConfig.from_dict(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        }
    )
    publisher = KVEventPublisher(cache, cfg, EventTranslator(BS, "CPU", "CPU_OFFLOAD")).start()
    m = mirror()

    def on_batch(seq: int, batch: KVEventBatch) -> None:
        for event in batch.events:
            m.apply(event)

    async def run() -> None:
        sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, on_batch, m.clear)
        task = asyncio.create_task(sub.run())
        try:
            await asyncio.wait_for(sub.synced.wait(), 10)
            for k in range(12):  # the pool holds 8 blocks: later inserts evict
                cache.insert([k + 10] * BS * 2, cache.allocate(2))
            cache.reset()
            cache.insert(C + A, cache.allocate(2))
            await asyncio.wait_for(
                until(lambda: paths(m) == set(cache.leaf_paths()), "the mirror"), 20
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sub.close()

    try:
        asyncio.run(run())
    finally:
        publisher.close()
    assert paths(m) == {(None, tuple(C + A))}
