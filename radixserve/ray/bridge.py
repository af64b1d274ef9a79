"""The ingress' side of the engine: the server's serving code, talking to engine replicas.

`RemoteEngine` is the server's `ServedEngine` for engines in Serve replicas: it gives the
OpenAI app what it reads from an engine (tokenizer, context length, model name, stats) and
answers plainly for what only a replica can do; `RemoteBridge` submits requests through a Ray
Serve handle instead of to an in-process engine, so `radixserve.server.app.build_app` serves
the same routes, errors, auth and streaming in front of Ray as it does alone.

A replica that dies is not the client's problem where that can be helped: a non-streamed
request is sent again (another replica answers), and so is a streamed one that has not
produced a token yet. A stream that breaks after its first token ends with an in-band error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from radixserve.engine.outputs import RequestMetrics, RequestOutput
from radixserve.engine.params import SamplingParams
from radixserve.engine.stats import EngineStats
from radixserve.errors import EngineDeadError
from radixserve.server.bridge import EngineBridge, OutputObserver
from radixserve.server.engine_api import ServedEngine

if TYPE_CHECKING:
    from radixserve.cache import CacheEvent, TreeSnapshot
    from radixserve.engine.handoff import FirstToken
    from radixserve.engine.request import OutputCallback
    from radixserve.engine.structured import GrammarCompiler
    from radixserve.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Tries of one request across replicas that die under it (the first included).
MAX_ATTEMPTS = 4
RETRY_BACKOFF_S = 0.5

T = TypeVar("T")


@dataclass
class EngineCall:
    """One request as the engine deployment receives it (and the request router reads it)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    namespace: str | None = None
    priority: int = 0
    session_id: str | None = None

    @property
    def prompt(self) -> str:
        """The prompt's tokens as one character each.

        For routers that read a text `prompt` (Ray's PrefixCacheAffinityRouter): its character
        tree then works on the exact tokens the engine caches.
        """
        return "".join(chr(0x10000 + t) for t in self.prompt_token_ids)


def replica_gone(e: BaseException) -> bool:
    """Whether `e` says the replica (actor) died or cannot be reached, not that it refused."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError))


def unwrap(e: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (no remote traceback in messages)."""
    from ray.exceptions import RayTaskError

    while isinstance(e, RayTaskError) and e.cause is not None:
        e = e.cause
    return e


def slim(out: RequestOutput) -> RequestOutput:
    """A mid-stream output without the cumulative fields (only the delta crosses the wire)."""
    return dataclasses.replace(out, prompt_token_ids=[], token_ids=[], text="")


class RemoteEngine(ServedEngine):
    """What the OpenAI app reads from an engine, for engines that live in Serve replicas.

    The ingress holds no engine and no cache of its own: grammars compile in the replica that
    takes the request, requests go through `RemoteBridge`, the routers read the replicas'
    cache events from the event log, and there is no reset route. The members for those
    raise NotImplementedError (a /v1/cache/tree request answers 500, as it always has here).
    """

    grammars: GrammarCompiler | None = None  # each replica compiles a request's grammar
    can_reset_prefix_cache = False  # one cache per replica; no route resets them all

    def __init__(self, tokenizer: Tokenizer, info: dict[str, Any], event_log: Any = None) -> None:
        self.tokenizer = tokenizer
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.block_size: int = info["block_size"]
        self.num_blocks: int = info["num_blocks"]
        self.event_log = event_log
        self._replica_stats: dict[str, dict[str, Any]] = {}
        self._refresh: asyncio.Task[None] | None = None

    def start_refreshing(self, interval: float = 1.0) -> None:
        """Keep the replicas' engine stats (pushed to the event log) fresh, on this loop."""
        if self.event_log is not None and self._refresh is None:
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_loop(interval))

    async def _refresh_loop(self, interval: float) -> None:
        while True:
            with contextlib.suppress(Exception):
                self._replica_stats = await self.event_log.replica_stats.remote()
            await asyncio.sleep(interval)

    def is_alive(self) -> bool:
        """The ingress can serve: Ray restarts replicas, requests wait for one meanwhile."""
        return True

    def stats(self) -> EngineStats:
        """The replicas' engine stats, summed (as of their last push, at most ~1 s old)."""
        total = EngineStats()
        for s in self._replica_stats.values():
            for f in dataclasses.fields(EngineStats):
                v = s.get(f.name)
                if isinstance(v, dict):
                    merged = getattr(total, f.name)
                    for k, n in v.items():
                        merged[k] = merged.get(k, 0) + n
                elif isinstance(v, int):
                    setattr(total, f.name, getattr(total, f.name) + v)
        return total

    def cache_stats(self) -> dict[str, object]:
        """Pool totals over the replicas, and each replica's counters."""
        s = self.stats()
        return {
            "block_size": self.block_size,
            "total_blocks": s.blocks_total,
            "free_blocks": s.blocks_free,
            "cached_blocks": s.blocks_cached,
            "locked_blocks": s.blocks_locked,
            "num_replicas": len(self._replica_stats),
            "replicas": self._replica_stats,
        }

    def cache_tree(self) -> TreeSnapshot | None:
        """Not here: each replica has its own tree."""
        raise _not_on_ingress("cache_tree")

    def cache_snapshot(self) -> list[tuple[Hashable, tuple[int, ...]]]:
        """Not here: each replica has its own tree (RadixEngine.cache_snapshot)."""
        raise _not_on_ingress("cache_snapshot")

    def add_cache_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Not here: the replicas' cache events go to the event log (build_app is given
        cache_events=False)."""
        raise _not_on_ingress("add_cache_listener")

    def remove_cache_listener(self, fn: Callable[[CacheEvent], None]) -> None:
        """Not here: nothing listens to the ingress (see add_cache_listener)."""
        raise _not_on_ingress("remove_cache_listener")

    def reset_prefix_cache(self) -> int:
        """Not here: `can_reset_prefix_cache` is False, so the app has no reset route."""
        raise _not_on_ingress("reset_prefix_cache")

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        namespace: Hashable = None,
        priority: int = 0,
        on_output: OutputCallback | None = None,
        bounded: bool = False,
        session_id: str | None = None,
        first_token: FirstToken | None = None,
        export_kv_from: int | None = None,
    ) -> str:
        """Not here: `RemoteBridge.submit` sends requests to the replicas."""
        raise _not_on_ingress("add_request")

    def abort(self, request_id: str) -> None:
        """Not here: a `RemoteStream` cancels its own request on its replica."""
        raise _not_on_ingress("abort")


def _not_on_ingress(member: str) -> NotImplementedError:
    return NotImplementedError(
        f"RemoteEngine.{member}: the Ray ingress holds no engine; its replicas do"
    )


class RemoteBridge(EngineBridge):
    """Submits requests to the engine deployment through a Serve handle."""

    def __init__(
        self,
        engine: RemoteEngine,
        handle: Any,
        observer: OutputObserver | None = None,
        on_resend: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(engine, observer)
        self.handle = handle
        self.on_resend = on_resend  # called each time a request is sent again

    supports_choices = False  # RemoteStream ends at the first finished choice

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        namespace: str | None = None,
        priority: int = 0,
        stream: bool = True,
        session_id: str | None = None,
        first_token: FirstToken | None = None,
        export_kv_from: int | None = None,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> RemoteStream:
        """Send the request; a streamed one is accepted (or refused) by a replica on return.
        (No `first_token`, `export_kv_from` or `on_finished`: prefill/decode disaggregation
        runs on `radixserve serve`.)"""
        if first_token is not None or export_kv_from is not None or on_finished is not None:
            raise _not_on_ingress("a K/V handoff")
        call = EngineCall(
            list(prompt_token_ids), params, request_id, namespace, priority, session_id
        )
        s = RemoteStream(self.handle, call, self.observer, self.on_resend)
        if stream:
            await s.start()
        return s


class RemoteStream:
    """A request's outputs from an engine replica (a `server.bridge.OutputStream`)."""

    num_choices = 1  # RemoteBridge.supports_choices is False

    def __init__(
        self,
        handle: Any,
        call: EngineCall,
        observer: OutputObserver | None,
        on_resend: Callable[[], None] | None = None,
    ) -> None:
        self.handle = handle
        self.call = call
        self.observer = observer
        self.on_resend = on_resend
        self.request_id = call.request_id
        self.finished = False
        self.client_gone = False
        self.final: RequestOutput | None = None
        self._gen: Any = None
        self._response: Any = None
        self._last_stamp: float | None = None
        self._yielded = False
        self._restarts = 0

    async def start(self) -> None:
        """Open the stream on a replica; retries while replicas die before accepting it."""

        async def open_stream() -> None:
            self._gen = self.handle.options(stream=True).generate.remote(self.call)
            await self._gen.__anext__()  # the replica's "accepted" marker (or its refusal)

        await self._retrying(open_stream, "before accepting")

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            try:
                out = await self._gen.__anext__()
            except StopAsyncIteration:
                out = self._error_output("the replica ended the stream early")
            except Exception as e:
                if replica_gone(e) and not self._yielded and self._restarts < MAX_ATTEMPTS:
                    log.warning("replica died before the first token of %s", self.request_id)
                    self._restarts += 1
                    self._resent()
                    await asyncio.sleep(RETRY_BACKOFF_S)
                    await self.start()
                    continue
                out = self._error_output(
                    f"the replica failed mid-stream: {type(unwrap(e)).__name__}"
                )
            self._observe(out)
            if out.finished:
                self.finished = True
                self.final = out
            self._yielded = self._yielded or bool(out.new_token_ids)
            yield out

    async def result(self) -> RequestOutput:
        """The final output of a non-streamed request, sent again if its replica dies."""

        async def complete() -> RequestOutput:
            self._response = self.handle.complete.remote(self.call)
            out: RequestOutput = await self._response
            return out

        out = await self._retrying(complete, "under")
        self._observe(out)
        self.finished, self.final = True, out
        return out

    async def results(self) -> list[RequestOutput]:
        """The final output of its one choice, as a list (see `result`)."""
        return [await self.result()]

    @property
    def finals(self) -> list[RequestOutput]:
        """Its one choice's last output, once finished."""
        return [self.final] if self.final is not None else []

    async def _retrying(self, attempt: Callable[[], Awaitable[T]], when: str) -> T:
        for n in range(MAX_ATTEMPTS):
            try:
                return await attempt()
            except Exception as e:
                if not replica_gone(e) or n == MAX_ATTEMPTS - 1:
                    raise _surface(e) from None
                log.warning("replica died %s %s; sending it again", when, self.request_id)
                self._resent()
                await asyncio.sleep(RETRY_BACKOFF_S)
        raise AssertionError("unreachable")

    def abort(self) -> None:
        """Cancel the request on its replica (which aborts it in the engine)."""
        if self.finished:
            return
        for r in (self._gen, self._response):
            if r is not None:
                with contextlib.suppress(Exception):
                    r.cancel()

    def close(self) -> None:
        """Release the request: cancel it if its consumer stopped before it finished."""
        self.abort()

    def _resent(self) -> None:
        if self.on_resend is not None:
            self.on_resend()

    def _observe(self, out: RequestOutput) -> None:
        stamp = time.monotonic()
        if self.observer is not None:
            self.observer.observe(out, stamp, self._last_stamp)
        if out.new_token_ids:
            self._last_stamp = stamp

    def _error_output(self, message: str) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.call.prompt_token_ids,
            token_ids=[],
            text="",
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            num_cached_tokens=0,
            metrics=RequestMetrics(arrival_time=time.monotonic()),
            error=message,
        )


def _surface(e: BaseException) -> BaseException:
    """What the app's error handler should see for a failed call."""
    if replica_gone(e):
        return EngineDeadError("no engine replica could take the request; retry later")
    return unwrap(e)
