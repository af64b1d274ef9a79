"""Subscribing to a worker's vLLM-format KV events: ZMQ SUB, with replay on connect and after
a gap in the sequence numbers, and a restart of the publisher noticed.

`KVEventSubscriber.run` connects, asks the replay socket (if there is one) for every batch it
still keeps, then applies live batches in order. A batch whose number skips ahead triggers a
replay of the missing ones. One numbered at or below the last applied is either a repeat of
a batch already applied from a replay (the same bytes: skipped) or the first sign that the
publisher restarted (numbering starts at 0 per process): the mirror is cleared and
everything replayed again. Without a replay socket a gap is logged and
counted (the mirror may miss what was in it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import zmq
import zmq.asyncio

from radixserve.server.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    KVEventBatch,
    WireError,
    decode_batch,
)

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 5.0
RECENT_BATCHES = 4096  # batches remembered to tell a repeat from a restarted publisher


class KVEventSource(NamedTuple):
    """Where a worker publishes vLLM-format KV events (`route --worker-kv-events`)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventSource:
        """'ENDPOINT[,REPLAY_ENDPOINT]' (tcp://HOST:PORT each); raises ValueError."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) > 2 or not all(p.startswith("tcp://") and p.count(":") >= 2 for p in parts):
            raise ValueError(
                f"{text!r} is not ENDPOINT[,REPLAY_ENDPOINT], e.g. "
                "tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"
            )
        return cls(parts[0], parts[1] if len(parts) == 2 else None)


@dataclass
class SubscriberStats:
    """What a subscriber has seen."""

    batches: int = 0
    replayed: int = 0
    gaps: int = 0  # gaps found in the live stream
    lost: int = 0  # gaps no replay could fill
    restarts: int = 0
    bad: int = 0  # payloads that did not decode


class KVEventSubscriber:
    """Feeds one publisher's batches, in order and once each, to `on_batch(seq, batch)`;
    `on_reset()` is called when everything applied so far must be forgotten (a restart)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        on_batch: Callable[[int, KVEventBatch], None],
        on_reset: Callable[[], None],
        topic: str = "",
        name: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.topic = topic.encode()
        self.name = name or endpoint
        self.stats = SubscriberStats()
        self.last: int | None = None  # the last sequence number applied
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> hash of what was applied
        self._whole_until = -1  # live seqs up to this are in a whole-cache batch replayed
        self.synced = asyncio.Event()  # set once the first replay (or connect) is done
        self._ctx = zmq.asyncio.Context()

    async def run(self) -> None:
        """Follow the publisher until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            await self._catch_up(0)
            self.synced.set()
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.stats.bad += 1
                    continue
                await self._live(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        """Release the ZMQ context (after `run` was cancelled)."""
        self._ctx.term()

    async def _live(self, seq: int, payload: bytes) -> None:
        last = self.last
        if last is not None and seq <= last:
            if self._recent.get(seq) == hash(payload) or seq <= self._whole_until:
                return  # already applied from a replay
            log.warning("kv events of %s restarted at seq %d (after %d)", self.name, seq, last)
            self.stats.restarts += 1
            self.on_reset()
            self.last = None
            self._recent.clear()
            await self._catch_up(0)
            if self.last is not None and seq <= self.last:
                return
            last = self.last
        if last is not None and seq > last + 1:
            self.stats.gaps += 1
            await self._catch_up(last + 1)
            if self.last is not None and seq <= self.last:
                return
            if self.last is not None and seq > self.last + 1:
                self.stats.lost += 1
                log.warning(
                    "kv events of %s: batches %d..%d are lost", self.name, self.last + 1, seq - 1
                )
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except WireError as e:
            self.stats.bad += 1
            log.warning("kv events of %s: batch %d unreadable: %s", self.name, seq, e)
        else:
            self.on_batch(seq, batch)
            self.stats.batches += 1
        self.last = seq
        self._recent[seq] = hash(payload)
        if len(self._recent) > RECENT_BATCHES:
            self._recent.popitem(last=False)

    async def _catch_up(self, start: int) -> None:
        """Apply every kept batch from `start` on (nothing without a replay socket)."""
        if self.replay_endpoint is None:
            return
        got = await self.replay(start)
        if got and got[0][0] > start:
            if _starts_with_clear(got[0][1]):
                # radixserve answers a request older than what it keeps with the whole cache,
                # numbered as its newest batch: live batches up to that one are in it.
                self._whole_until = got[0][0]
            else:
                self.stats.lost += 1  # the publisher no longer keeps batches start.. (vLLM)
                log.warning("kv events of %s: batches from %d are gone", self.name, start)
        for seq, payload in got:
            if self.last is None or seq > self.last:
                self._apply(seq, payload)
                self.stats.replayed += 1

    async def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The publisher's kept batches from `start` on, as (seq, payload); [] if the replay
        socket does not answer within REPLAY_TIMEOUT_S."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) != 3 or frames[1] == END_SEQ:
                    break
                out.append((int.from_bytes(frames[1], "big"), frames[2]))
        except asyncio.TimeoutError:
            log.warning("kv events of %s: no answer from %s", self.name, self.replay_endpoint)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=0)
        return out


def _starts_with_clear(payload: bytes) -> bool:
    """Whether a batch opens with AllBlocksCleared (a whole-cache batch: nothing is lost)."""
    try:
        events = decode_batch(payload).events
    except WireError:
        return False
    return bool(events) and isinstance(events[0], AllBlocksCleared)
