"""`radixserve serve`: load the engine, serve the OpenAI-compatible app with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from radixserve import options
from radixserve.worker_options import WorkerOptions, add_worker_args

log = logging.getLogger("radixserve.server")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the options of one serving process: the worker options plus its address."""
    add_worker_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument(
        "--port", type=options.port, default=8000, help="port to bind (default: 8000)"
    )


def startup_line(engine: Any, model_name: str, host: str, port: int, prefix_cache: bool) -> str:
    """The one line logged when the server is up."""
    tokens = engine.num_blocks * engine.block_size
    host_part = f"[{host}]" if ":" in host else host
    return (
        f"radixserve serving {model_name} ({engine.dtype}, {engine.device}, weights "
        f"{engine.quantization}, attention {engine.runner.attn.name}); KV pool "
        f"{engine.num_blocks} blocks x {engine.block_size} = {tokens} tokens; prefix cache "
        f"{'on' if prefix_cache else 'off'}; max_model_len {engine.max_model_len}; "
        f"listening on http://{host_part}:{port}"
    )


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; in-flight requests get --shutdown-timeout to finish."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from radixserve.engine.engine import LLMEngine

    # Start-up errors propagate: radixserve.cli prints them as one line (after the checks
    # of radixserve.preflight, which run before this).
    engine = LLMEngine(WorkerOptions.from_namespace(args).engine_config())
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
        dashboard_show_text=args.dashboard_show_text,
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
        config, on_started=lambda: log.info(line), on_exit=app.state.cache_events.close
    )
    # uvicorn re-raises the signal it handled once it has shut down; with these handlers in
    # place that re-raise is a no-op, so a graceful shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1


class _Server(uvicorn.Server):
    """uvicorn.Server that logs once it listens and ends endless streams when asked to exit."""

    def __init__(
        self, config: uvicorn.Config, on_started: Callable[[], None], on_exit: Callable[[], None]
    ) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            self._on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_exit)
