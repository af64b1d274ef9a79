"""`radixserve route`: the cache-aware router in front of running workers."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from radixserve.engine.tokenizer import Tokenizer
from radixserve.errors import ConfigError
from radixserve.model.files import resolve_model
from radixserve.options import add_options, from_args, option, types
from radixserve.router.kv_subscriber import KVEventSource
from radixserve.router.policy import POLICIES, PolicyConfig
from radixserve.router.worker import WorkerConfig
from radixserve.router.worker_checks import check_worker
from radixserve.server.config import HttpConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouteConfig(HttpConfig):
    """The router's own options (besides HttpConfig's address, key and log level)."""

    worker: list[str] = option(
        [],
        "a worker's base URL, e.g. http://127.0.0.1:8001 (repeat)",
        repeat=True,
        metavar="URL",
    )
    worker_kv_events: list[str] = option(
        [],
        "the vLLM-format KV events of the --worker of the same position, as "
        "ENDPOINT[,REPLAY_ENDPOINT] (e.g. tcp://127.0.0.1:5557,tcp://127.0.0.1:5558), or "
        "'none' for a worker mirrored through its /v1/cache/events; give one per --worker "
        "(repeat)",
        repeat=True,
        metavar="ENDPOINT",
    )
    policy: str = option("cache_aware", "how to pick a worker", choices=POLICIES)
    model: str | None = option(
        None,
        "model whose tokenizer and chat template the workers use",
        default_text="the default model",
    )
    worker_api_key: str | None = option(
        None, "key to send to the workers", default_text="--api-key, else the client's"
    )
    normalize_whitespace: bool = option(
        False,
        "strip message contents and turn \\r\\n into \\n before routing and forwarding (more "
        "cache hits, prompts no longer byte-exact)",
    )
    request_timeout: float = option(
        600.0, "seconds to wait for a worker's answer", type=types.positive_float
    )
    seed: int | None = option(None, "seed of the random policy", type=types.whole_number)
    pd_disaggregation: bool = option(
        False,
        "prefill/decode disaggregation (SGLang's router flag): each request goes to a --decode "
        "worker, which takes its prompt's K/V from the --prefill worker the router names; "
        "--policy places both halves (docs/disaggregation.md)",
    )
    prefill: list[str] = option(
        [],
        "with --pd-disaggregation: a prefill worker's base URL (`serve --disaggregation-mode "
        "prefill`; repeat)",
        repeat=True,
        metavar="URL",
    )
    decode: list[str] = option(
        [],
        "with --pd-disaggregation: a decode worker's base URL (`serve --disaggregation-mode "
        "decode`; repeat)",
        repeat=True,
        metavar="URL",
    )


def add_route_args(parser: argparse.ArgumentParser) -> None:
    """The `route` command's flags (also used by `serve --workers N`, which fills them in)."""
    for cls in (RouteConfig, PolicyConfig, WorkerConfig):
        add_options(parser, cls, "route")


def load_tokenizer(model: str | None) -> Tokenizer:
    """The model's tokenizer and chat template (no weights are loaded)."""
    return Tokenizer.from_dir(resolve_model(model, weights=False).path)


def build_router_app(args: argparse.Namespace, tokenizer: Any = None) -> Any:
    """The router's FastAPI app from parsed `route` arguments."""
    from radixserve.router.app import build_app
    from radixserve.router.balancer import Balancer
    from radixserve.router.metrics import RouterMetrics
    from radixserve.router.worker import Worker

    route = from_args(RouteConfig, args)
    if not route.worker and not route.pd_disaggregation:
        raise ConfigError("give at least one --worker URL, e.g. --worker http://127.0.0.1:8001")
    if route.policy == "cache_aware" and tokenizer is None:
        tokenizer = load_tokenizer(route.model)
    worker_key = route.worker_api_key or route.api_key
    headers = {"authorization": f"Bearer {worker_key}"} if worker_key else {}
    cfg = from_args(WorkerConfig, args, headers=headers)
    timeout = httpx.Timeout(route.request_timeout, connect=5.0)
    # Idle connections expire before uvicorn's 5 s keep-alive closes them under us.
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0)
    client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
    metrics = RouterMetrics()
    policy_cfg = from_args(PolicyConfig, args)

    def balancer_of(urls: list[str], sources: list[KVEventSource | None]) -> Balancer:
        workers = [Worker(i, url, client, cfg, metrics, sources[i]) for i, url in enumerate(urls)]
        return Balancer(workers, route.policy, metrics, tokenizer, policy_cfg, route.seed)

    if route.pd_disaggregation:  # requests to decode workers, each naming a prefill worker
        balancer = balancer_of(route.decode, [None] * len(route.decode))
        prefill = balancer_of(route.prefill, [None] * len(route.prefill))
    else:
        balancer, prefill = balancer_of(route.worker, kv_event_sources(route)), None
    return build_app(
        balancer, client, metrics, route.api_key, worker_key, route.normalize_whitespace,
        prefill,
    )  # fmt: skip


def kv_event_sources(route: RouteConfig) -> list[KVEventSource | None]:
    """Each worker's vLLM-format event source (None: its /v1/cache/events); raises
    ConfigError unless --worker-kv-events is absent or given once per --worker."""
    if not route.worker_kv_events:
        return [None] * len(route.worker)
    if len(route.worker_kv_events) != len(route.worker):
        raise ConfigError(
            f"--worker-kv-events is given {len(route.worker_kv_events)} times for "
            f"{len(route.worker)} --worker: give one per worker, in the same order ('none' "
            "for a worker without)"
        )
    out: list[KVEventSource | None] = []
    for text in route.worker_kv_events:
        try:
            out.append(None if text.strip().lower() == "none" else KVEventSource.parse(text))
        except ValueError as e:
            raise ConfigError(f"--worker-kv-events {e}") from None
    return out


def check_kv_event_workers(route: RouteConfig, tokenizer: Any, block_size: int | None) -> None:
    """Before serving: every worker mirrored from block events must tokenize as the router
    does and use its --block-size (ConfigError otherwise); unreachable ones are skipped."""
    sources = kv_event_sources(route)
    key = route.worker_api_key or route.api_key
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(timeout=30.0, headers=headers, trust_env=False) as client:
        for url, source in zip(route.worker, sources, strict=True):
            if source is not None:
                check_worker(client, url.rstrip("/"), tokenizer, block_size)


def run_route(args: argparse.Namespace) -> int:
    """Serve the router until interrupted."""
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per worker call
    route = from_args(RouteConfig, args)
    tokenizer = None
    if route.worker_kv_events:
        tokenizer = load_tokenizer(route.model)
        check_kv_event_workers(route, tokenizer, args.block_size)
    app = build_router_app(args, tokenizer)
    if route.pd_disaggregation:
        log.info(
            "routing %s over %d prefill and %d decode workers on http://%s:%d",
            args.policy, len(route.prefill), len(route.decode), args.host, args.port,
        )  # fmt: skip
    else:
        log.info(
            "routing %s over %d workers on http://%s:%d",
            args.policy, len(args.worker), args.host, args.port,
        )  # fmt: skip
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=5,
    )
    return 0
