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
    a("--workers", type=int, default=1, help="N>1: N engine workers behind the cache-aware router")
    _add_eviction_args(parser)
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
        "eviction_policy": args.eviction_policy,
        "session_ttl": args.session_ttl,
        "namespace_quota": args.namespace_quota,
        "refetch_window": args.refetch_window,
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
    tiers = None
    if args.api_key_tiers:
        from radixserve.server.tiers import load_api_key_tiers

        try:
            tiers = load_api_key_tiers(args.api_key_tiers)
        except ValueError as e:
            log.error("%s", e)
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
        return _serve(engine, args, tiers)
    finally:
        engine.shutdown()


def _serve(engine: Any, args: argparse.Namespace, tiers: dict[str, int] | None = None) -> int:
    from radixserve.server.app import build_app

    app = build_app(
        engine,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        default_max_tokens=args.default_max_tokens,
        api_key_tiers=tiers,
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


def _add_eviction_args(parser: argparse.ArgumentParser) -> None:
    """The prefix cache's eviction options (docs/eviction.md)."""
    from radixserve.cache import DEFAULT_POLICY, POLICIES

    g = parser.add_argument_group("eviction")
    g.add_argument(
        "--eviction-policy",
        choices=list(POLICIES),
        default=None,
        help=f"which cached prefixes go first when the pool is full (default: {DEFAULT_POLICY})",
    )
    g.add_argument(
        "--session-ttl",
        type=_non_negative,
        default=None,
        metavar="SECONDS",
        help="keep the path of requests with a session id ('user' or an x-session-id header) "
        "warm this long after each turn (default: 0, off)",
    )
    g.add_argument(
        "--namespace-quota",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="share of the pool one namespace (cache_salt) may keep in unlocked blocks before "
        "it is evicted from first (default: no quota)",
    )
    g.add_argument(
        "--api-key-tiers",
        default=None,
        metavar="FILE",
        help='JSON {"api key": tier}: those keys are accepted, and a request\'s eviction tier '
        "(for --eviction-policy priority) is its key's",
    )
    g.add_argument(
        "--refetch-window",
        type=_non_negative,
        default=None,
        metavar="SECONDS",
        help="a block prefilled again this soon after its eviction counts in "
        "radixserve_cache_refetch_blocks_total (default: 60; 0: off)",
    )


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _port_taken(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
