"""`radixserve route`: the cache-aware router in front of running workers."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import httpx

from radixserve import options
from radixserve.errors import ConfigError
from radixserve.router.policy import POLICIES, PolicyConfig

log = logging.getLogger(__name__)


def add_route_args(parser: argparse.ArgumentParser) -> None:
    """The `route` command's flags (also used by `serve --workers N`, which fills them in)."""
    parser.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="a worker's base URL, e.g. http://127.0.0.1:8001 (repeat)",
    )
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=options.port, default=8000)
    parser.add_argument(
        "--model",
        default=None,
        help="model whose tokenizer and chat template the workers use (default: the default model)",
    )
    parser.add_argument(
        "--api-key", default=None, help="require this key from clients (and send it to the workers)"
    )
    parser.add_argument(
        "--worker-api-key",
        default=None,
        help="key to send to the workers (default: --api-key, else the client's)",
    )
    parser.add_argument(
        "--block-size",
        type=options.block_size,
        default=None,
        help="the workers' block size (default: read from /v1/cache/stats)",
    )
    parser.add_argument(
        "--cache-threshold",
        type=options.fraction,
        default=PolicyConfig.cache_threshold,
        help="route by cache when the best match beats the least-loaded "
        "worker's by this fraction of the prompt",
    )
    parser.add_argument(
        "--balance-abs-threshold",
        type=options.non_negative_int,
        default=PolicyConfig.balance_abs_threshold,
        help="loads are uneven when max-min in-flight exceeds this ...",
    )
    parser.add_argument(
        "--balance-rel-threshold",
        type=options.float_in(1.0),
        default=PolicyConfig.balance_rel_threshold,
        help="... and max exceeds this times min",
    )
    parser.add_argument(
        "--health-interval",
        type=options.positive_float,
        default=2.0,
        help="seconds between /health probes of each worker",
    )
    parser.add_argument(
        "--no-cache-events",
        action="store_true",
        help="do not subscribe to /v1/cache/events; mirror routed prompts only",
    )
    parser.add_argument(
        "--mirror-blocks",
        type=options.positive_int,
        default=None,
        help="blocks per worker mirror (default: the worker's pool size)",
    )
    parser.add_argument(
        "--normalize-whitespace",
        action="store_true",
        help="strip message contents and turn \\r\\n into \\n before routing "
        "and forwarding (more cache hits, prompts no longer byte-exact)",
    )
    parser.add_argument(
        "--request-timeout",
        type=options.positive_float,
        default=600.0,
        help="seconds to wait for a worker's answer",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the random policy")
    parser.add_argument("--log-level", default="info", choices=options.LOG_LEVELS)


def load_tokenizer(model: str | None) -> Any:
    """The model's tokenizer and chat template (no weights are loaded)."""
    from radixserve.engine.tokenizer import Tokenizer
    from radixserve.model.loader import resolve_model

    return Tokenizer.from_dir(resolve_model(model, weights=False).path)


def build_router_app(args: argparse.Namespace, tokenizer: Any = None) -> Any:
    """The router's FastAPI app from parsed `route` arguments."""
    from radixserve.router.app import build_app
    from radixserve.router.balancer import Balancer
    from radixserve.router.metrics import RouterMetrics
    from radixserve.router.worker import Worker, WorkerConfig

    if not args.worker:
        raise ConfigError("give at least one --worker URL, e.g. --worker http://127.0.0.1:8001")
    if args.policy == "cache_aware" and tokenizer is None:
        tokenizer = load_tokenizer(args.model)
    worker_key = args.worker_api_key or args.api_key
    cfg = WorkerConfig(
        health_interval=args.health_interval,
        cache_events=not args.no_cache_events,
        block_size=args.block_size,
        mirror_blocks=args.mirror_blocks,
        headers={"authorization": f"Bearer {worker_key}"} if worker_key else {},
    )
    timeout = httpx.Timeout(args.request_timeout, connect=5.0)
    # Idle connections expire before uvicorn's 5 s keep-alive closes them under us.
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0)
    client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
    metrics = RouterMetrics()
    workers = [Worker(i, url, client, cfg, metrics) for i, url in enumerate(args.worker)]
    policy_cfg = PolicyConfig(
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
    )
    balancer = Balancer(workers, args.policy, metrics, tokenizer, policy_cfg, args.seed)
    return build_app(balancer, client, metrics, args.api_key, worker_key, args.normalize_whitespace)


def run_route(args: argparse.Namespace) -> int:
    """Serve the router until interrupted."""
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per worker call
    app = build_router_app(args)
    log.info(
        "routing %s over %d workers on http://%s:%d",
        args.policy,
        len(args.worker),
        args.host,
        args.port,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=5,
    )
    return 0
