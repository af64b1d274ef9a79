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

log = logging.getLogger("radixserve.server")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


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
    # KV offload tier and warm restart (docs/kv-offload.md)
    a(
        "--kv-offload-memory",
        default=None,
        help="second KV tier under the prefix cache: evicted blocks move there instead of "
        "being dropped (host memory, or the file of --kv-offload-dir), e.g. 8GiB",
    )
    a(
        "--kv-offload-dir",
        default=None,
        help="put the offload tier in a memory-mapped file in this directory "
        "(size: --kv-offload-memory, default 4x the pool)",
    )
    a(
        "--kv-persist-dir",
        default=None,
        help="warm restart: save the prefix cache here on graceful shutdown, load it at start",
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
        "kv_offload_memory": getattr(args, "kv_offload_memory", None),
        "kv_offload_dir": getattr(args, "kv_offload_dir", None),
        "kv_persist_dir": getattr(args, "kv_persist_dir", None),
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

        if getattr(args, "kv_offload_dir", None) or getattr(args, "kv_persist_dir", None):
            log.error("--kv-offload-dir and --kv-persist-dir take one worker (one engine a dir)")
            return 2

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


def _port_taken(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
