"""The ZMQ publisher of `--kv-events-config` over a cache in this process: frames, order,
replay, the whole-cache batch, and that nothing a subscriber does can hold it up."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import zmq

from radixserve.cache import BlockPool, CacheEvent, RadixCache
from radixserve.errors import ConfigError
from radixserve.router.kv_mirror import BlockMirror
from radixserve.router.trie import WorkerTrie
from radixserve.server.kv_events.config import KVEventsConfig
from radixserve.server.kv_events.publisher import KVEventPublisher
from radixserve.server.kv_events.translate import EventTranslator
from radixserve.server.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
)
from tests.support import free_port, wait_for

BS = 4


def put(cache: RadixCache, tokens: list[int]) -> None:
    cache.insert(tokens, cache.allocate(len(tokens) // BS))


def publisher(cache: RadixCache, **config: object) -> KVEventPublisher:
    values = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "topic": "kv",
        **config,
    }
    cfg = KVEventsConfig.from_dict(values)
    return KVEventPublisher(cache, cfg, EventTranslator(BS, "CPU", "CPU_OFFLOAD")).start()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: KVEventPublisher, start: int
) -> list[list[bytes]]:
    """The frames of every answer to one replay request, end marker included."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(str(pub.replay_endpoint))
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    frames = []
    while True:
        assert sock.poll(10_000), "no replay answer"
        got = sock.recv_multipart()
        frames.append(got)
        if got[2] == END_SEQ:
            return frames


def test_batch_zero_holds_the_cache_as_it_was_at_start() -> None:
    cache = RadixCache(BlockPool(16), BS)
    put(cache, [1] * 8)
    pub = publisher(cache)
    try:
        with zmq.Context() as ctx:
            frames = replay(ctx, pub, 0)
    finally:
        pub.close()
    assert frames[-1] == [b"", b"", END_SEQ, b""]
    empty, topic, seq, payload = frames[0]
    assert (empty, topic, int.from_bytes(seq, "big")) == (b"", b"kv", 0)
    events = decode_batch(payload).events
    assert isinstance(events[0], AllBlocksCleared)
    assert isinstance(events[1], BlockStored) and events[1].token_ids == [1] * 8


def test_live_batches_carry_the_topic_and_consecutive_sequence_numbers(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    cache = RadixCache(BlockPool(64), BS)
    pub = publisher(cache)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    try:
        # A SUB socket hears nothing until its subscription reached the publisher: keep
        # changing the cache until a batch arrives.
        n = [1]

        def heard() -> list[bytes] | None:
            n[0] += 1
            put(cache, [n[0]] * BS)
            return sub.recv_multipart() if sub.poll(100) else None

        first = wait_for(heard, 20, "a live batch")
        seqs = [int.from_bytes(first[1], "big")]
        for k in range(5):
            put(cache, [1000 + k] * BS)
            assert sub.poll(10_000)
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big"))
            (ev,) = decode_batch(payload).events
            assert isinstance(ev, BlockStored) and ev.token_ids == [1000 + k] * BS
        assert seqs == list(range(seqs[0], seqs[0] + 6))
    finally:
        pub.close()


def test_replay_returns_kept_batches_from_the_asked_seq(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    cache = RadixCache(BlockPool(64), BS)
    pub = publisher(cache)
    try:
        for k in range(4):
            put(cache, [10 + k] * BS)
            wait_for(lambda k=k: pub.batches_sent == k + 2, 10, "the batch to go out")
        frames = replay(ctx, pub, 2)
    finally:
        pub.close()
    seqs = [int.from_bytes(f[2], "big") for f in frames[:-1]]
    assert seqs == [2, 3, 4]


def test_replay_from_before_the_kept_batches_starts_with_the_whole_cache(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    cache = RadixCache(BlockPool(64), BS)
    pub = publisher(cache, buffer_steps=2)
    try:
        for k in range(5):
            put(cache, [10 + k] * BS)
            wait_for(lambda k=k: pub.batches_sent == k + 2, 10, "the batch to go out")
        frames = replay(ctx, pub, 0)
    finally:
        pub.close()
    (whole, end) = frames
    assert int.from_bytes(whole[2], "big") == 5  # numbered as the newest batch
    mirror = BlockMirror(WorkerTrie(BS, 256))
    for event in decode_batch(whole[3]).events:
        mirror.apply(event)
    assert set(mirror.trie.paths()) == set(cache.leaf_paths())


def test_an_endpoint_in_use_is_a_config_error_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"endpoint tcp://127.0.0.1:{port}"):
            publisher(RadixCache(BlockPool(4), BS), endpoint=f"tcp://127.0.0.1:{port}")


def test_a_subscriber_that_never_reads_does_not_hold_up_publishing(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    cache = RadixCache(BlockPool(4096), BS)
    pub = publisher(cache, hwm=1)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.connect(pub.endpoint)
    try:
        for k in range(3000):
            put(cache, [k] * BS)
        wait_for(lambda: pub.stats()["pending"] == 0, 60, "the queue to drain")
        sent = pub.batches_sent
    finally:
        pub.close()
    assert sent >= 2
    received = 0
    while sub.poll(0):
        sub.recv_multipart()
        received += 1
    assert received < 3000  # the high-water marks dropped what it did not read


def test_a_full_queue_is_followed_by_the_whole_cache() -> None:
    cache = RadixCache(BlockPool(64), BS)
    pub = publisher(cache, max_queue_size=2)
    gate = threading.Event()
    translate = pub.translator.translate

    def stuck(event: CacheEvent) -> list[KVEvent]:
        gate.wait()  # the publisher thread stops here while the engine keeps going
        return translate(event)

    pub.translator.translate = stuck  # type: ignore[method-assign]
    try:
        for k in range(6):  # more events than the queue holds
            put(cache, [20 + k] * BS)
        gate.set()
        wait_for(lambda: pub.stats()["overflows"] == 1, 10, "the overflow to be handled")
        wait_for(lambda: pub.stats()["pending"] == 0, 10, "the queue to drain")
        with zmq.Context() as ctx:
            frames = replay(ctx, pub, 0)
    finally:
        gate.set()
        pub.close()
    batches = [decode_batch(f[3]) for f in frames[:-1]]
    mirror = BlockMirror(WorkerTrie(BS, 256))
    for batch in batches:
        for event in batch.events:
            mirror.apply(event)
    assert any(isinstance(b.events[0], AllBlocksCleared) for b in batches[1:])
    assert set(mirror.trie.paths()) == set(cache.leaf_paths())


def test_batches_are_kv_event_batches_of_rank_zero(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = publisher(RadixCache(BlockPool(4), BS))
    try:
        frames = replay(ctx, pub, 0)
    finally:
        pub.close()
    batch = decode_batch(frames[0][3])
    assert isinstance(batch, KVEventBatch) and batch.data_parallel_rank == 0 and batch.ts > 0
