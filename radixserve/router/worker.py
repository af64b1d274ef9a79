"""One upstream worker as the router sees it: health, load, and a live mirror of its cache."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixserve.options import option, types
from radixserve.router.kv_mirror import BlockMirror, BlockSizeMismatch
from radixserve.router.kv_subscriber import KVEventSource, KVEventSubscriber
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import WorkerView
from radixserve.router.trie import WorkerTrie
from radixserve.router.worker_checks import vllm_cache_config
from radixserve.server.kv_events.wire import KVEventBatch

log = logging.getLogger(__name__)

# Errors that mean the worker's process or socket is gone (not merely slow).
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


@dataclass
class WorkerConfig:
    """How the router watches its workers."""

    health_interval: float = option(
        2.0, "seconds between /health probes of each worker", type=types.positive_float
    )
    health_timeout: float = 5.0
    health_failures: int = 2  # consecutive failed probes (not refused) before a worker is down
    cache_events: bool = option(
        True,
        "do not subscribe to /v1/cache/events; mirror routed prompts only",
        flag="--no-cache-events",
    )
    block_size: int | None = option(
        None,
        "the workers' block size",
        type=types.block_size,
        default_text="read from /v1/cache/stats, else 16",
    )
    mirror_blocks: int | None = option(
        None, "blocks per worker mirror", type=types.positive_int, default_text="the worker's pool"
    )
    headers: dict[str, str] = field(default_factory=dict)  # sent on every worker call


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """Decode a server-sent-event stream into its JSON `data` payloads."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif line == "" and data:
            text, data = "\n".join(data), []
            try:
                obj = json.loads(text)
            except ValueError:
                log.warning("ignoring a cache event that is not JSON: %.80s", text)
                continue
            if isinstance(obj, dict):
                yield obj


def _int(stats: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = stats.get(k)
        if isinstance(v, int) and v > 0:
            return v
    return None


class Worker:
    """A worker's URL, health, in-flight count and the router's mirror of its prefix cache."""

    def __init__(
        self,
        index: int,
        url: str,
        client: httpx.AsyncClient,
        cfg: WorkerConfig,
        metrics: RouterMetrics,
        kv_events: KVEventSource | None = None,
    ) -> None:
        self.index = index
        self.kv_events = kv_events  # vLLM-format events over ZMQ instead of /v1/cache/events
        self.kv_subscriber: KVEventSubscriber | None = None
        self.url = url.rstrip("/")
        self.name = self.url
        self.client = client
        self.cfg = cfg
        self.metrics = metrics
        self.healthy = False
        self.in_flight = 0
        self.pending_blocks = 0  # blocks of prompts in flight that the mirror did not hold
        self.events_live = False
        self.events_supported = cfg.cache_events
        self.block_size = cfg.block_size or 16
        self.num_blocks = 0  # the worker's pool size, 0 until known
        self.trie = WorkerTrie(self.block_size, cfg.mirror_blocks or 65536)
        self.last_error: str | None = None
        self._failures = 0
        self._drift: tuple[int, int] | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._events_task: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[bool] | None = None
        metrics.add_worker(self.name)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe once now, then keep probing in the background."""
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        """Stop background tasks."""
        for task in (self._health_task, self._events_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._health_task = self._events_task = None

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval)
            try:
                await self.check_health()
            except Exception:  # a probe must never end the loop
                log.exception("health check of %s failed unexpectedly", self.name)

    async def check_health(self) -> bool:
        """One /health probe; takes the worker out of rotation or back in as needed."""
        try:
            r = await self.client.get(
                self.url + "/health", headers=self.cfg.headers, timeout=self.cfg.health_timeout
            )
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.ConnectError as e:
            ok, why = False, f"unreachable: {e!r}"
            self._failures = self.cfg.health_failures  # refused: certainly down
        except httpx.HTTPError as e:
            ok, why = False, f"/health failed: {e!r}"
        if ok:
            self._failures = 0
            if not self.healthy:
                await self.mark_up()
            elif self.events_live:
                await self._check_drift()
        else:
            self._failures += 1
            if self.healthy and self._failures >= self.cfg.health_failures:
                self.mark_down(why)
            self.last_error = why
        return ok

    async def mark_up(self) -> None:
        """Put the worker in rotation: learn its cache geometry, start mirroring its cache."""
        await self._read_cache_stats()
        self.events_supported = self.cfg.cache_events  # a restarted worker may have them now
        self.trie = WorkerTrie(self.block_size, self._mirror_capacity())
        self.healthy = True
        self.last_error = None
        self.metrics.worker_up.labels(self.name).set(1)
        log.info("worker %s is up (block_size %d)", self.name, self.block_size)
        if self.kv_events is not None and self._events_task is None:
            self._events_task = asyncio.create_task(self._kv_events_loop(self.kv_events))
        elif self.events_supported and self._events_task is None:
            self._events_task = asyncio.create_task(self._events_loop())

    def connection_failed(self, e: Exception) -> None:
        """A request to the worker failed in transport: down if refused, else probe it now.

        A dropped connection alone may be a keep-alive race with a healthy worker, so only a
        probe (refused, or failing repeatedly) takes it out of rotation.
        """
        if isinstance(e, httpx.ConnectError):
            self._failures = self.cfg.health_failures
            self.mark_down(f"unreachable: {e!r}")
        elif isinstance(e, CONNECTION_ERRORS) and self.healthy:
            self._probe = asyncio.create_task(self.check_health())

    def mark_down(self, why: str) -> None:
        """Take the worker out of rotation and drop its mirror (its cache is unknown now)."""
        if self._events_task is not None:
            self._events_task.cancel()
            self._events_task = None
        was = self.healthy
        self.healthy = False
        self.events_live = False
        self.last_error = why
        self.trie.clear()
        self.metrics.worker_up.labels(self.name).set(0)
        self.metrics.events_live.labels(self.name).set(0)
        self.metrics.tree_blocks.labels(self.name).set(0)
        if was:
            log.warning("worker %s is down: %s", self.name, why)

    async def _get_stats(self) -> dict[str, Any]:
        try:
            r = await self.client.get(
                self.url + "/v1/cache/stats", headers=self.cfg.headers, timeout=5.0
            )
            stats = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            stats = {}
        return stats if isinstance(stats, dict) else {}

    async def _read_cache_stats(self) -> None:
        stats = await self._get_stats() or await self._vllm_cache_config()
        bs = _int(stats, "block_size")
        if self.cfg.block_size and bs and bs != self.cfg.block_size:
            log.warning(
                "%s reports block_size %d, not %d; using %d", self.name, bs, self.cfg.block_size, bs
            )
        self.block_size = bs or self.cfg.block_size or 16
        self.num_blocks = _int(stats, "num_blocks", "blocks_total", "total_blocks") or 0

    async def _vllm_cache_config(self) -> dict[str, Any]:
        """vLLM's block size and pool from /metrics (`vllm:cache_config_info` labels)."""
        try:
            r = await self.client.get(self.url + "/metrics", headers=self.cfg.headers, timeout=5.0)
        except httpx.HTTPError:
            return {}
        return vllm_cache_config(r.text) if r.status_code == 200 else {}

    async def _check_drift(self) -> None:
        """Resync (fresh snapshot) if the mirror's size disagrees with the worker's, steadily.

        Events arrive a little after the stats are taken, so one disagreement means nothing;
        the same disagreement on two probes in a row means the mirror drifted.
        """
        stats = await self._get_stats()
        cached = stats.get("cached_blocks")
        if not isinstance(cached, int) or self.kv_events is not None:
            # Block events are numbered: a gap is replayed, so there is no drift to find.
            return
        seen: tuple[int, int] | None = (cached, self.trie.num_blocks)
        if cached != self.trie.num_blocks and seen == self._drift:
            log.warning(
                "mirror of %s drifted (%d blocks there, %d here); resyncing",
                self.name,
                cached,
                self.trie.num_blocks,
            )
            self.metrics.mirror_resyncs.labels(self.name).inc()
            self.resync()
            seen = None
        self._drift = seen

    def resync(self) -> None:
        """Reconnect the cache event stream, which starts with a fresh snapshot."""
        if self._events_task is not None:
            self._events_task.cancel()
            self._events_task = None
        self.events_live = False
        if self.healthy and self.kv_events is not None:
            self.trie.clear()
            self._events_task = asyncio.create_task(self._kv_events_loop(self.kv_events))
        elif self.healthy and self.events_supported:
            self._events_task = asyncio.create_task(self._events_loop())

    def _mirror_capacity(self) -> int:
        if self.cfg.mirror_blocks:
            return self.cfg.mirror_blocks
        # The worker's cache never holds more than its pool; a little slack for event order.
        return self.num_blocks + 64 if self.num_blocks else 65536

    # ---- cache events ----------------------------------------------------------------------
    async def _events_loop(self) -> None:
        backoff = 0.5
        while self.healthy:
            try:
                await self._follow_events()
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a broken stream or a malformed event: reconnect
                log.info("cache events of %s interrupted: %r", self.name, e)
            finally:
                self.events_live = False
                self.metrics.events_live.labels(self.name).set(0)
            if not self.events_supported:
                self._events_task = None
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
        self._events_task = None

    async def _follow_events(self) -> None:
        timeout = httpx.Timeout(10.0, read=None)
        async with self.client.stream(
            "GET", self.url + "/v1/cache/events", headers=self.cfg.headers, timeout=timeout
        ) as r:
            if r.status_code in (404, 405, 501):
                log.warning("%s has no /v1/cache/events; recording routed prompts", self.name)
                self.events_supported = False
                return
            if r.status_code != 200:
                raise httpx.HTTPError(f"/v1/cache/events answered {r.status_code}")
            async for event in sse_events(r.aiter_lines()):
                self.apply_event(event)

    async def _kv_events_loop(self, source: KVEventSource) -> None:
        """Mirror the worker's cache from its vLLM-format events until cancelled."""
        mirror = BlockMirror(self.trie)

        def on_batch(seq: int, batch: KVEventBatch) -> None:
            mirror.trie = self.trie  # mark_up may have replaced the trie
            for event in batch.events:
                mirror.apply(event)
            self.metrics.tree_blocks.labels(self.name).set(self.trie.num_blocks)

        sub = KVEventSubscriber(
            source.endpoint, source.replay_endpoint, on_batch, mirror.clear, source.topic,
            self.name,
        )  # fmt: skip
        self.kv_subscriber = sub
        task = asyncio.create_task(sub.run())
        try:
            await sub.synced.wait()
            self.events_live = True
            self.metrics.events_live.labels(self.name).set(1)
            log.info("mirroring %s's cache from kv events at %s", self.name, source.endpoint)
            await task
        except BlockSizeMismatch as e:
            log.error("kv events of %s: %s", self.name, e)
            self.last_error = str(e)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            sub.close()
            self.events_live = False
            self.metrics.events_live.labels(self.name).set(0)
            self._events_task = None

    def apply_event(self, event: dict[str, Any]) -> None:
        """Apply one cache event (snapshot / insert / evict) to the mirror."""
        kind = event.get("type")
        if kind == "snapshot":
            paths = [(p.get("namespace"), p["token_ids"]) for p in event.get("paths") or []]
            self.trie.load(paths)
            self.events_live = True
            self.metrics.events_live.labels(self.name).set(1)
            log.info("mirroring %s's cache: %d paths", self.name, len(paths))
        elif kind == "insert":
            self.trie.insert(event["token_ids"], event.get("namespace"))
        elif kind == "evict":
            n = event.get("num_tokens")
            self.trie.remove(
                event["token_ids"], event.get("namespace"), n if isinstance(n, int) else None
            )
        self.metrics.tree_blocks.labels(self.name).set(self.trie.num_blocks)

    # ---- routing ---------------------------------------------------------------------------
    def view(self, token_ids: list[int] | None, namespace: str | None) -> WorkerView:
        """The policy's snapshot of this worker for one prompt.

        Its cache counts the prompts in flight to it as well: the worker caches them once
        prefilled, and its events tell the mirror only then.
        """
        matched = self.trie.match(token_ids, namespace) if token_ids else 0
        return WorkerView(
            index=self.index,
            in_flight=self.in_flight,
            matched_tokens=matched,
            continues=bool(token_ids and self.trie.continues(token_ids, namespace, matched)),
            cached_blocks=self.trie.num_blocks + self.pending_blocks,
            total_blocks=self.num_blocks,
            block_size=self.block_size,
        )

    def record_routed(self, token_ids: list[int], namespace: str | None) -> None:
        """Without a live event stream, assume the worker will cache what it was sent."""
        if not self.events_live and token_ids:
            self.trie.insert(token_ids, namespace)
            self.metrics.tree_blocks.labels(self.name).set(self.trie.num_blocks)

    def begin(self, prompt_tokens: int = 0, matched_tokens: int = 0) -> int:
        """A request was sent (a prompt of `prompt_tokens`, if known, of which the mirror holds
        `matched_tokens`, as the routing decision saw); give `end` what this returns."""
        self.in_flight += 1
        self.metrics.in_flight.labels(self.name).set(self.in_flight)
        if not self.events_live:  # without events the mirror has the prompt already
            return 0
        fresh = max(0, prompt_tokens - matched_tokens) // self.block_size
        self.pending_blocks += fresh
        return fresh

    def end(self, pending: int = 0) -> None:
        """A request to this worker finished (any way); `pending` is what `begin` returned."""
        self.in_flight = max(0, self.in_flight - 1)
        self.metrics.in_flight.labels(self.name).set(self.in_flight)
        self.pending_blocks = max(0, self.pending_blocks - pending)

    def state(self) -> dict[str, Any]:
        """JSON-able state for /health and /v1/router/workers."""
        return {
            "index": self.index,
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "cache_events_live": self.events_live,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "mirror_blocks": self.trie.num_blocks,
            "pending_blocks": self.pending_blocks,
            "kv_events": None if self.kv_events is None else self.kv_events.endpoint,
            "kv_events_stats": (
                None if self.kv_subscriber is None else vars(self.kv_subscriber.stats)
            ),
            "last_error": self.last_error,
        }
