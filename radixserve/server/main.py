"""`radixserve serve`: load the engine, serve the OpenAI-compatible app with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from radixserve.options import add_options
from radixserve.server.config import ServerConfig, WorkerOptions
from radixserve.server.kv_events.start import start_kv_events
from radixserve.server.lifecycle import FAULT_ENV, install_fault_injection, watch_engine

log = logging.getLogger("radixserve.server")

# Seconds a server whose engine died keeps answering 503 before it drains and exits 1.
ENGINE_DEAD_LINGER_S = 2.0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the options of one serving process (radixserve.server.config.WorkerOptions)."""
    add_options(parser, WorkerOptions, "serve")


def startup_line(engine: Any, model_name: str, host: str, port: int, prefix_cache: bool) -> str:
    """The one line logged when the server is up."""
    tokens = engine.num_blocks * engine.block_size
    host_part = f"[{host}]" if ":" in host else host
    return (
        f"radixserve serving {model_name} ({engine.dtype}, {engine.device}, weights "
        f"{engine.quantization}, attention {engine.runner.attn.name}); KV pool "
        f"({engine.kv_cache_dtype}) "
        f"{engine.num_blocks} blocks x {engine.block_size} = {tokens} tokens; prefix cache "
        f"{'on' if prefix_cache else 'off'}; max_model_len {engine.max_model_len}; "
        f"listening on http://{host_part}:{port}"
    )


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now (model, tokenizer, app: about 300,000) into
    the permanent generation that garbage collections skip, and turn collection back on
    (`run_serve` turns it off while it imports and loads); returns how many it holds. A full
    collection over them stalled the engine loop for ~270 ms on a 2-core CPU; new objects
    are still collected (vLLM freezes its start-up heap the same way)."""
    gc.collect()
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; in-flight requests get --shutdown-timeout to finish."""
    # Start-up allocates a few hundred thousand objects that live as long as the server
    # (imports, the tokenizer's vocabulary, the model's modules): collecting among them
    # while they pile up took about 10% of a 1B's start. freeze_startup_heap turns it on
    # once serving; a start-up error leaves it on too.
    gc.disable()
    try:
        return _start_and_serve(args)
    finally:
        gc.enable()


def _start_and_serve(args: argparse.Namespace) -> int:
    opts = WorkerOptions.from_namespace(args)
    logging.basicConfig(
        level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tiers = None
    if opts.api_key_tiers:
        from radixserve.server.tiers import load_api_key_tiers

        tiers = load_api_key_tiers(opts.api_key_tiers)  # a bad file: ValueError, one line
    from radixserve.engine.engine import LLMEngine

    # Start-up errors propagate: radixserve.cli prints them as one line (after the checks
    # of radixserve.preflight, which run before this).
    engine = LLMEngine(opts.engine_config())
    fault = os.environ.get(FAULT_ENV)
    if fault:
        install_fault_injection(engine, fault)  # a bad spec is a ValueError: one line, exit 2
    try:
        engine.start()
        return _serve(engine, opts.server_config(), tiers)
    finally:
        engine.shutdown()


def _serve(engine: Any, cfg: ServerConfig, tiers: dict[str, int] | None = None) -> int:
    from radixserve.server.app import build_app

    app = build_app(
        engine,
        api_key=cfg.api_key,
        served_model_name=cfg.served_model_name,
        default_max_tokens=cfg.default_max_tokens,
        dashboard_show_text=cfg.dashboard_show_text,
        api_key_tiers=tiers,
        disaggregation_mode=cfg.disaggregation_mode,
        disaggregation_transfer_backend=cfg.disaggregation_transfer_backend,
    )
    line = startup_line(
        engine,
        cfg.served_model_name or engine.model_name,
        cfg.host,
        cfg.port,
        engine.config.enable_prefix_cache,
    )
    publisher = start_kv_events(engine, cfg.kv_events_config)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        # uvicorn waits for a float just as well; its annotation says int
        timeout_graceful_shutdown=cfg.shutdown_timeout,  # type: ignore[arg-type]
    )

    def on_started() -> None:
        log.info(line)
        frozen = freeze_startup_heap()
        log.info("start-up heap: %d objects frozen out of garbage collection", frozen)
        # Built from here: their thread competed for the interpreter's lock with the start.
        engine.prepare_structured_outputs(background=True)  # requests wait for what they need

    server = _Server(
        config,
        on_started=on_started,
        on_exit=app.state.cache_events.close,
        engine=engine,
        drain=_drain_of(app),
        drain_timeout=cfg.shutdown_timeout,
    )
    # uvicorn re-raises the signal it handled once it has shut down; with these handlers in
    # place that re-raise is a no-op, so a graceful shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        if publisher is not None:
            publisher.close()
    if server.engine_died:
        return 1  # a supervisor (systemd, Kubernetes, serve --workers N) restarts us
    return 0 if server.started else 1


def _drain_of(app: Any) -> Any:
    """The app's Drain middleware instance (built on first use of the middleware stack)."""
    from radixserve.server.lifecycle import Drain

    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()
    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, Drain):
        layer = getattr(layer, "app", None)
    if layer is None:
        raise RuntimeError("the app has no Drain middleware")
    return layer


class _Server(uvicorn.Server):
    """uvicorn.Server that logs once it listens, drains on the first SIGTERM/SIGINT (new
    requests get 503 while in-flight ones finish, then uvicorn shuts down; a second signal
    forces the exit), and exits soon after the engine loop dies."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_started: Callable[[], None],
        on_exit: Callable[[], None],
        engine: Any,
        drain: Any,
        drain_timeout: float,
    ) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._on_exit = on_exit
        self._engine = engine
        self._drain = drain
        self._drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.engine_died = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            self._on_started()
            self._spawn(watch_engine(self._engine, self._engine_dead))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain.draining or self._loop is None or self._loop.is_closed():
            super().handle_exit(sig, frame)  # a second signal: uvicorn forces the exit
            return
        self._loop.call_soon_threadsafe(self._begin_drain, self._drain_timeout)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _begin_drain(self, timeout: float) -> None:
        if self._drain.draining:
            return
        log.info("draining: new requests get 503; waiting up to %.0f s for in-flight", timeout)
        self._drain.begin()
        self._on_exit()
        self._spawn(self._exit_when_idle(timeout))

    async def _exit_when_idle(self, timeout: float) -> None:
        if not await self._drain.wait_idle(timeout):
            log.warning("shutdown timeout: %d requests still in flight", self._drain.in_flight)
        self.should_exit = True

    def _engine_dead(self) -> None:
        if self._drain.draining:
            return  # the engine stops as part of an ordinary shutdown
        log.error("the engine loop died; draining and exiting non-zero so a supervisor restarts")
        self.engine_died = True
        # Its requests already ended with an error. For a moment new requests and /health
        # get 503 engine_dead (so probes and load balancers see why), then the process ends.
        self._spawn(self._drain_later(ENGINE_DEAD_LINGER_S))

    async def _drain_later(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._begin_drain(min(self._drain_timeout, 5.0))
