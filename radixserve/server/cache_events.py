"""`GET /v1/cache/events`: the prefix cache's insert/evict events as server-sent events.

One engine listener per app fans events out to subscribers. The listener runs on the engine
thread and only hands the event to the event loop (`call_soon_threadsafe`); each subscriber
has a bounded queue. A subscriber that falls behind loses its queued events and is sent a
fresh snapshot instead. Consumers should treat an insert of a known path and an evict of an
unknown path as no-ops: events racing with a snapshot may be delivered after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from radixserve.cache import CacheEvent
from radixserve.server.errors import APIError
from radixserve.server.protocol import sse

if TYPE_CHECKING:
    from radixserve.server.engine_api import ServedEngine

log = logging.getLogger(__name__)

PING_SECONDS = 15.0

_OVERFLOW = object()  # queue marker: events were dropped, resend a snapshot
_CLOSE = object()  # queue marker: the server is shutting down


def event_dict(event: CacheEvent) -> dict[str, Any]:
    """A CacheEvent as the JSON object of the wire format."""
    return {
        "type": str(event.kind),
        "namespace": _namespace(event.namespace),
        "token_ids": [int(t) for t in event.token_ids],
        "num_tokens": int(event.num_tokens),  # the run at the end of the path that changed
    }


def _namespace(ns: Any) -> str | None:
    # The server's namespaces are cache salts (str) or None; anything else is shown as text.
    return ns if ns is None or isinstance(ns, str) else str(ns)


class _Subscriber:
    def __init__(self, maxsize: int) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue(maxsize)

    def put(self, item: object) -> None:
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self._replace_all(_OVERFLOW)

    def close(self) -> None:
        self._replace_all(_CLOSE)

    def _replace_all(self, marker: object) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(marker)


class CacheEventHub:
    """Fans the engine's cache events out to `/v1/cache/events` subscribers."""

    def __init__(self, engine: ServedEngine, max_queue: int = 4096) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._subscribers: set[_Subscriber] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._listening = False

    @property
    def num_subscribers(self) -> int:
        """How many clients are connected now."""
        return len(self._subscribers)

    def _on_engine_event(self, event: CacheEvent) -> None:
        # Engine thread: do nothing costly, never raise.
        if self._subscribers and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # loop closed
                self._loop.call_soon_threadsafe(self._dispatch, event)

    def _dispatch(self, event: CacheEvent) -> None:
        if not self._subscribers:
            return
        data = event_dict(event)
        for sub in list(self._subscribers):
            sub.put(data)

    def _snapshot(self) -> bytes:
        paths = [
            {"namespace": _namespace(ns), "token_ids": [int(t) for t in ids]}
            for ns, ids in self.engine.cache_snapshot()
        ]
        return sse({"type": "snapshot", "paths": paths})

    def close(self) -> None:
        """End every subscriber's stream (called when the server begins to shut down)."""
        self._closed = True
        for sub in list(self._subscribers):
            sub.close()

    def _subscribe(self) -> _Subscriber:
        self._loop = asyncio.get_running_loop()
        if not self._subscribers and not self._listening:
            self.engine.add_cache_listener(self._on_engine_event)
            self._listening = True
        sub = _Subscriber(self.max_queue)
        self._subscribers.add(sub)
        return sub

    def _unsubscribe(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)
        # The engine stops paying for events once nobody listens.
        if not self._subscribers and self._listening:
            self.engine.remove_cache_listener(self._on_engine_event)
            self._listening = False

    async def stream(self) -> AsyncIterator[bytes]:
        """SSE frames for one subscriber: a snapshot, then events until it leaves."""
        sub = self._subscribe()  # before the snapshot, so no event is missed
        try:
            if self._closed:
                return
            yield self._snapshot()
            async for frame in self._follow(sub):
                yield frame
        except Exception as e:  # an engine failure must not leave a half-written stream
            log.exception("cache event stream failed")
            yield sse(APIError(500, f"cache event stream failed: {type(e).__name__}").body())
        finally:
            self._unsubscribe(sub)

    async def _follow(self, sub: _Subscriber) -> AsyncIterator[bytes]:
        while True:
            try:
                item = await asyncio.wait_for(sub.queue.get(), PING_SECONDS)
            except asyncio.TimeoutError:
                yield b": ping\n\n"  # keeps proxies from timing the stream out
                continue
            if item is _CLOSE:
                return
            if item is _OVERFLOW:
                yield self._snapshot()
                continue
            assert isinstance(item, dict)
            yield sse(item)
