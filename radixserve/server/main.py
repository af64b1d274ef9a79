"""`radixserve serve`: load the engine, serve the OpenAI-compatible app with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from radixserve.errors import RadixServeError
from radixserve.server.lifecycle import FAULT_ENV, install_fault_injection, watch_engine

log = logging.getLogger("radixserve.server")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Seconds a server whose engine died keeps answering 503 before it drains and exits 1.
ENGINE_DEAD_LINGER_S = 2.0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` options to `parser`."""
    a = parser.add_argument
    a("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    a("--served-model-name", default=None, help="model name of the API (default: from --model)")
    a("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    a("--port", type=int, default=8000, help="port to bind (default: 8000)")
    a(
        "--api-key",
        default=os.environ.get("RADIXSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $RADIXSERVE_API_KEY)",
    )
    a("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    a("--device", default="auto", choices=("auto", "cpu", "cuda"))
    a("--kv-cache-memory", default="2GiB", help="size of the KV-cache pool (default: 2GiB)")
    a("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    a("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    a("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step")
    a("--max-num-seqs", type=int, default=None, help="requests running at once")
    a("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    a(
        "--max-waiting",
        type=int,
        default=None,
        help="waiting-queue limit; requests beyond it get 503 + Retry-After",
    )
    a("--schedule-policy", default=None, help="engine scheduling policy (default: the engine's)")
    a("--num-threads", type=int, default=None, help="torch CPU threads")
    a(
        "--default-max-tokens",
        type=int,
        default=256,
        help="max_tokens of requests that set none, capped by the context (default: 256)",
    )
    a(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish on SIGTERM/SIGINT (default: 30)",
    )
    a("--workers", type=int, default=1, help="N>1: N engine workers behind the cache-aware router")
    a("--log-level", default="info", choices=LOG_LEVELS)


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig the serve options describe (unset options keep the engine's defaults)."""
    from radixserve.engine.engine import EngineConfig

    kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "kv_cache_memory": args.kv_cache_memory,
        "block_size": args.block_size,
        "enable_prefix_cache": not args.no_prefix_cache,
    }
    optional = {
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "max_waiting": args.max_waiting,
        "schedule_policy": args.schedule_policy,
        "num_threads": args.num_threads,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return EngineConfig(**kwargs)


def startup_line(engine: Any, model_name: str, host: str, port: int, prefix_cache: bool) -> str:
    """The one line logged when the server is up."""
    tokens = engine.num_blocks * engine.block_size
    host_part = f"[{host}]" if ":" in host else host
    return (
        f"radixserve serving {model_name} ({engine.dtype}, {engine.device}); KV pool "
        f"{engine.num_blocks} blocks x {engine.block_size} = {tokens} tokens; prefix cache "
        f"{'on' if prefix_cache else 'off'}; max_model_len {engine.max_model_len}; "
        f"listening on http://{host_part}:{port}"
    )


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; in-flight requests get --shutdown-timeout to finish."""
    if args.workers > 1:
        from radixserve.router.launcher import serve_workers

        return int(serve_workers(args) or 0)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.api_key is not None and not args.api_key:
        log.error("--api-key must not be empty")
        return 2
    if _port_taken(args.host, args.port):
        log.error("cannot bind %s:%d: the address is in use", args.host, args.port)
        return 1
    from radixserve.engine.engine import LLMEngine

    try:
        engine = LLMEngine(engine_config(args))
    except RadixServeError as e:
        log.error("cannot start the engine: %s", e)
        return 2
    fault = os.environ.get(FAULT_ENV)
    if fault:
        try:
            install_fault_injection(engine, fault)
        except ValueError as e:
            log.error("%s", e)
            return 2
    try:
        engine.start()
        return _serve(engine, args)
    finally:
        engine.shutdown()


def _serve(engine: Any, args: argparse.Namespace) -> int:
    from radixserve.server.app import build_app

    app = build_app(
        engine,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens,
    )
    line = startup_line(
        engine,
        args.served_model_name or engine.model_name,
        args.host,
        args.port,
        not args.no_prefix_cache,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = _Server(
        config,
        on_started=lambda: log.info(line),
        on_exit=app.state.cache_events.close,
        engine=engine,
        drain=_drain_of(app),
        drain_timeout=args.shutdown_timeout,
    )
    # uvicorn re-raises the signal it handled once it has shut down; with these handlers in
    # place that re-raise is a no-op, so a graceful shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
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


def _port_taken(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
