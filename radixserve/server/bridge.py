"""The bridge between the asyncio app and the engine thread.

The engine calls `on_output` on its own thread after each step; the callback only stamps the
time and hands the output to the request's asyncio queue with `loop.call_soon_threadsafe`, so
the engine thread never waits for the app. A request whose consumer goes away (client
disconnect, cancelled task) is aborted in the engine, which releases its locks and blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from starlette.requests import Request

from radixserve.engine.handoff import FirstToken
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.params import SamplingParams

if TYPE_CHECKING:
    from radixserve.server.engine_api import ServedEngine


class OutputObserver(Protocol):
    """Receives every output of every request, with the time the engine produced it."""

    def observe(self, output: RequestOutput, stamp: float, prev_stamp: float | None) -> None:
        """Called on the event loop for each output, in order."""


class OutputStream(Protocol):
    """A submitted request's outputs as the serving code reads them: `RequestStream` here,
    `RemoteStream` (radixserve/ray/bridge.py) on the Ray ingress."""

    client_gone: bool  # set when the client disconnects (abort_on_disconnect)

    @property
    def num_choices(self) -> int:
        """How many choices (n) the outputs carry; each output says which (`index`)."""

    @property
    def finished(self) -> bool:
        """Whether every choice has finished."""

    @property
    def final(self) -> RequestOutput | None:
        """Choice 0's last output, once finished."""

    @property
    def finals(self) -> list[RequestOutput]:
        """Every choice's last output, by index, once finished."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Every output of every choice, in order, until all have finished."""

    async def results(self) -> list[RequestOutput]:
        """Wait for every choice's last output (by index), for a non-streamed response."""

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent)."""

    def close(self) -> None:
        """Release the request: abort it if its consumer stopped before it finished."""


class RequestStream:
    """Outputs of one engine request as an async iterator; `close()` aborts it if unfinished."""

    def __init__(
        self,
        engine: ServedEngine,
        loop: asyncio.AbstractEventLoop,
        observer: OutputObserver | None,
        num_choices: int = 1,
    ) -> None:
        self._engine = engine
        self.num_choices = num_choices
        self._loop = loop
        self._observer = observer
        self._queue: asyncio.Queue[tuple[float, RequestOutput]] = asyncio.Queue()
        self._last_stamp: float | None = None
        self.request_id: str | None = None
        self.finished = False
        self.client_gone = False
        self.final: RequestOutput | None = None  # choice 0's last output
        self.finals: list[RequestOutput] = []  # every choice's, by index, once all finished

    def on_output(self, output: RequestOutput) -> None:
        """Engine-thread callback: must be quick and must not raise."""
        item = (time.monotonic(), output)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            stamp, output = await self._queue.get()
            if self._observer is not None:
                self._observer.observe(output, stamp, self._last_stamp)
            if output.new_token_ids:
                self._last_stamp = stamp
            if output.finished:
                self.finals.append(output)
                if len(self.finals) == self.num_choices:
                    self.finished = True
                    self.finals.sort(key=lambda o: o.index)
                    self.final = self.finals[0]
            yield output

    async def result(self) -> RequestOutput:
        """Wait for the final output (of choice 0)."""
        async for _ in self:
            pass
        assert self.final is not None
        return self.final

    async def results(self) -> list[RequestOutput]:
        """Wait for the final output of every choice, by index."""
        await self.result()
        return self.finals

    def abort(self) -> None:
        """Abort the request in the engine unless it already finished (idempotent)."""
        if not self.finished and self.request_id is not None:
            self._engine.abort(self.request_id)

    def close(self) -> None:
        """Release the request: abort it if its consumer stopped before it finished."""
        self.abort()


class EngineBridge:
    """Submits requests to an in-process engine from the event loop."""

    supports_choices = True  # streams carry n > 1 choices (RequestStream.results)

    def __init__(self, engine: ServedEngine, observer: OutputObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer

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
    ) -> OutputStream:
        """Add a request; raises the engine's validation errors (QueueFullError, ...) directly.

        `stream` says whether the caller reads every output or only the last; a bridge to a
        remote engine may use it, this one does not need to. Prefill/decode disaggregation
        (server/disagg.py): `first_token` was drawn by a prefill worker, whose K/V this engine
        holds; with `export_kv_from` the finished output carries the K/V computed here from
        that token on, and `on_finished(output)` runs on the event loop once it is there.
        """
        loop = asyncio.get_running_loop()
        out = RequestStream(self.engine, loop, self.observer, params.n)

        def on_output(output: RequestOutput) -> None:
            out.on_output(output)
            if output.finished and on_finished is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    loop.call_soon_threadsafe(on_finished, output)

        out.request_id = self.engine.add_request(
            prompt_token_ids,
            params,
            request_id=request_id,
            namespace=namespace,
            priority=priority,
            on_output=out.on_output if on_finished is None else on_output,
            bounded=True,
            session_id=session_id,
            first_token=first_token,
            export_kv_from=export_kv_from,
        )
        return out


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, stream: OutputStream) -> AsyncIterator[None]:
    """While inside, a client that closes its connection aborts `stream`'s request."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                stream.client_gone = True
                stream.abort()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
