"""The ZMQ publisher of `--kv-events-config`: the prefix cache's events in vLLM's format.

The engine thread only appends each cache event to a queue (the listener does nothing
else, so publishing never lengthens a step); a daemon thread turns queued events into one
`KVEventBatch`, numbers it, sends it on the PUB socket and keeps it for replay. A PUB socket
never blocks: messages for a subscriber past the high-water mark are dropped. The same
thread answers the ROUTER replay socket: a request of [empty frame,] 8-byte start seq gets
[empty frame,] topic, seq, payload for each kept batch from that seq on, then the end marker
(an empty topic, seq -1, an empty payload), as vLLM does. A request older than the oldest
kept batch first gets the whole cache as one batch (AllBlocksCleared, then a BlockStored per
node) numbered as the newest batch sent, so a late subscriber still mirrors the cache
exactly. Batch 0 is that whole-cache batch too: after a warm restart it holds a BlockStored
for every restored block.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any

import zmq

from radixserve.cache import CacheEvent, PrefixCache
from radixserve.errors import ConfigError
from radixserve.server.kv_events.config import KVEventsConfig, parse_endpoint
from radixserve.server.kv_events.translate import EventTranslator
from radixserve.server.kv_events.wire import END_SEQ, KVEvent, KVEventBatch, encode_batch

log = logging.getLogger(__name__)

REPLAY_POLL_S = 0.05  # how long the thread sleeps between replay checks when idle


class KVEventPublisher:
    """Publishes one cache's events on ZMQ as vLLM does; `start` binds, `close` stops.

    `cache` is the engine's prefix cache (`engine.kv.cache`); `translator` knows its block
    size and media. Binding failures raise ConfigError naming the endpoint.
    """

    def __init__(
        self, cache: PrefixCache, config: KVEventsConfig, translator: EventTranslator
    ) -> None:
        self.cache = cache
        self.config = config
        self.translator = translator
        self._topic = config.topic.encode()
        self._pending: deque[CacheEvent] = deque()
        self._overflow = False
        self._wake = threading.Event()
        self._stop = False
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = config.endpoint  # as bound (a tcp port 0 becomes the real port)
        self.replay_endpoint = config.replay_endpoint
        self.batches_sent = 0
        self.events_dropped = 0

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> KVEventPublisher:
        """Bind (or connect) the sockets, listen to the cache, publish the whole cache as
        batch 0 and start the thread. Raises ConfigError if an endpoint cannot be bound."""
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = self._open(self._pub, self.config.endpoint, "endpoint")
            if self.config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._open(
                    self._replay, self.config.replay_endpoint, "replay_endpoint"
                )
        except ConfigError:
            self._close_sockets()
            raise
        # Listen first, then copy the cache: events in between are applied on top of the
        # copy, which is harmless (each event sets a block's presence; see docs/kv-events.md).
        self.cache.add_listener(self._on_event, detail=True)
        self._send(self.translator.snapshot(self.cache.export_nodes()))
        self._thread = threading.Thread(target=self._run, name="radixserve-kv-events", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop listening, publish what is queued, stop the thread and close the sockets."""
        with contextlib.suppress(ValueError):
            self.cache.remove_listener(self._on_event)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._close_sockets()

    def _open(self, sock: zmq.Socket[bytes], address: str, key: str) -> str:
        ep = parse_endpoint(address, key)
        try:
            if not ep.bind:
                sock.connect(address)
                return address
            sock.bind(address)
        except zmq.ZMQError as e:
            raise ConfigError(
                f"--kv-events-config: cannot {'bind' if ep.bind else 'connect'} {key} "
                f"{address}: {e.strerror}; pick another address or port"
            ) from None
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()

    # ---- the engine thread's part -----------------------------------------------------------
    def _on_event(self, event: CacheEvent) -> None:
        """Engine thread, under the cache lock: queue and wake, nothing more."""
        if len(self._pending) >= self.config.max_queue_size:
            self._overflow = True
            return
        self._pending.append(event)
        self._wake.set()

    # ---- the publisher thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(REPLAY_POLL_S if self._replay is not None else None)
            self._wake.clear()
            try:
                self._serve_replays()
                self._publish_pending()
            except Exception:  # keep publishing whatever one batch did
                log.exception("kv events: publishing failed")
            if self._stop and not self._pending:
                return

    def _publish_pending(self) -> None:
        pending = self._pending
        if self._overflow:
            # Events were dropped, so those queued before them must go too: the next batch is
            # the whole cache, then only what is queued after this copy was taken.
            self._overflow = False
            pending.clear()
            self.events_dropped += 1
            log.warning("kv events: queue full (max_queue_size); resending the whole cache")
            self._send(self.translator.snapshot(self.cache.export_nodes()))
        events: list[KVEvent] = []
        while pending:
            events += self.translator.translate(pending.popleft())
        if events:
            self._send(events)

    def _send(self, events: list[KVEvent]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(KVEventBatch(time.time(), events, 0))
        assert self._pub is not None
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.batches_sent += 1

    def _serve_replays(self) -> None:
        sock = self._replay
        while sock is not None and sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) == 3 and frames[1] == b"":
                client, head, start_bytes = frames[0], [b""], frames[2]
            elif len(frames) == 2:
                client, head, start_bytes = frames[0], [], frames[1]
            else:
                log.warning("kv events: ignoring a replay request of %d frames", len(frames))
                continue
            start = int.from_bytes(start_bytes, "big", signed=True)
            for seq, payload in self._replay_batches(start):
                sock.send_multipart([client, *head, self._topic, seq.to_bytes(8, "big"), payload])
            sock.send_multipart([client, *head, b"", END_SEQ, b""])

    def _replay_batches(self, start: int) -> list[tuple[int, bytes]]:
        kept = list(self._buffer)
        if kept and start < kept[0][0]:
            # What the request needs is gone: the whole cache now, as of the newest batch.
            events = self.translator.snapshot(self.cache.export_nodes())
            whole = encode_batch(KVEventBatch(time.time(), events, 0))
            return [(kept[-1][0], whole)]
        return [(seq, payload) for seq, payload in kept if seq >= start]

    def stats(self) -> dict[str, Any]:
        """Counts for logs and tests."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "batches_sent": self.batches_sent,
            "overflows": self.events_dropped,
            "pending": len(self._pending),
        }
