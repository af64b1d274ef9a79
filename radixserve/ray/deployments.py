"""The Ray Serve application: engine replicas behind an OpenAI-compatible ingress.

`RadixEngine` holds one `LLMEngine` per replica and publishes its cache events;
`OpenAIIngress` serves radixserve's own FastAPI app (`server.app.build_app`: same routes,
streaming, usage, errors, auth) and reaches the engines through a handle whose request router
is `RadixRequestRouter`. `build_app` assembles both from one `WorkerOptions`; `app_builder`
is the same for `serve run radixserve.ray.deployments:app_builder` and Serve config files.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from radixserve.ray.bridge import EngineCall, RemoteBridge, RemoteEngine, slim
from radixserve.ray.events import EventPublisher, get_event_log
from radixserve.server.config import WorkerOptions

log = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "RadixEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
APP_NAME = "radixserve"
# Request routers of the engine deployment, by the names `serve --ray-router` takes.
ROUTERS = {
    "radix": "radixserve.ray.router.RadixRequestRouter",
    "pow2": None,  # Ray Serve's default: power of two choices
    # Ray's PrefixCacheAffinityRouter. Its public path, ray.serve.llm.request_router, needs
    # the `ray[llm]` extra (vLLM, pyarrow); the class itself does not, so we name its module.
    "prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
    ".PrefixCacheAffinityRouter",
}


class RadixEngine:
    """One engine per replica; `generate` streams a request's outputs, `complete` returns one."""

    def __init__(self, options: dict[str, Any]) -> None:
        from radixserve.engine.engine import LLMEngine
        from radixserve.server.bridge import EngineBridge

        opts = WorkerOptions.from_dict(options)
        logging.getLogger("radixserve").setLevel(opts.log_level.upper())
        self.engine = LLMEngine(opts.engine_config())
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.to_full_id_str()
        # Before start(): the cache is empty, so the published numbering starts exact.
        self.events = EventPublisher(
            self.engine, self.replica, get_event_log(ctx.app_name, ctx.deployment)
        )
        self.engine.prepare_structured_outputs()
        self.engine.start()
        self.bridge = EngineBridge(self.engine)
        self.model_name = opts.served_model_name or self.engine.model_name

    async def _submit(self, call: EngineCall) -> Any:
        return await self.bridge.submit(
            call.prompt_token_ids,
            call.params,
            call.request_id,
            call.namespace,
            call.priority,
            session_id=call.session_id,
        )

    async def generate(self, call: EngineCall) -> AsyncIterator[Any]:
        """Yield None once the engine accepted the request, then its outputs (deltas only)."""
        stream = await self._submit(call)
        try:
            yield None
            async for out in stream:
                yield out if out.finished else slim(out)
        finally:
            stream.close()  # cancelled by the caller: abort in the engine

    async def complete(self, call: EngineCall) -> Any:
        """The request's final output."""
        stream = await self._submit(call)
        try:
            return await stream.result()
        finally:
            stream.close()

    def info(self) -> dict[str, Any]:
        """What the ingress needs to know of the model and the cache geometry."""
        e = self.engine
        return {
            "model_name": self.model_name,
            "max_model_len": e.max_model_len,
            "block_size": e.block_size,
            "num_blocks": e.num_blocks,
            "replica": self.replica,
        }

    def cache_snapshot(self) -> dict[str, Any]:
        """This replica's name and cached paths (to check the routers' mirrors against)."""
        return {"replica": self.replica, "paths": self.engine.cache_snapshot()}

    def check_health(self) -> None:
        """Serve's health check: a dead engine thread makes Ray replace the replica."""
        if not self.engine.is_alive():
            raise RuntimeError("the engine loop has stopped")

    def __del__(self) -> None:
        self.events.close()
        self.engine.shutdown()


@serve.ingress()
class OpenAIIngress:
    """radixserve's OpenAI app, with the engines reached through a Serve handle."""

    def __init__(self, engine: Any, options: dict[str, Any]) -> None:
        self.engine_handle = engine
        self.opts = WorkerOptions.from_dict(options)

    async def __serve_build_asgi_app__(self) -> Any:
        from prometheus_client import Counter

        from radixserve.engine.tokenizer import Tokenizer
        from radixserve.model.files import resolve_model
        from radixserve.server.app import build_app as build_openai_app
        from radixserve.server.metrics import ServerMetrics

        info = await self.engine_handle.info.remote()
        tokenizer = Tokenizer.from_dir(resolve_model(self.opts.model).path)
        ctx = serve.get_replica_context()
        remote = RemoteEngine(tokenizer, info, get_event_log(ctx.app_name, ENGINE_DEPLOYMENT))

        def bridge(metrics: ServerMetrics) -> RemoteBridge:
            resent = Counter(
                "radixserve_ray_resent_requests",
                "Requests sent again to an engine replica because theirs died",
                registry=metrics.registry,
            )
            return RemoteBridge(remote, self.engine_handle, metrics, on_resend=resent.inc)

        app = build_openai_app(
            remote,
            api_key=self.opts.api_key,
            served_model_name=self.opts.served_model_name or info["model_name"],
            default_max_tokens=self.opts.default_max_tokens,
            bridge_factory=bridge,
            cache_events=False,  # per replica; the routers read them from the event log
        )
        remote.start_refreshing()  # on the replica's loop, which serves the app too
        return app


@dataclass
class RayDeployment:
    """How the engine deployment is laid out on the cluster (the worker's options aside)."""

    num_replicas: int = 1
    num_cpus: float | None = None  # per engine replica; default: its num_threads, else 1
    num_gpus: float = 0
    router: str = "radix"  # a key of ROUTERS
    router_kwargs: dict[str, Any] = field(default_factory=dict)
    autoscaling_config: dict[str, Any] | None = None  # instead of num_replicas
    max_ongoing_requests: int = 64  # per engine replica (the engine queues the rest itself)
    ingress_replicas: int = 1


def build_app(opts: WorkerOptions, layout: RayDeployment | None = None) -> Any:
    """The bound Serve application: `OpenAIIngress` over `RadixEngine` replicas."""
    layout = layout or RayDeployment()
    if layout.router not in ROUTERS:
        raise ValueError(f"unknown router {layout.router!r}; choose one of {', '.join(ROUTERS)}")
    cpus = layout.num_cpus or opts.num_threads or 1
    if opts.num_threads is None:  # one replica's torch threads fit the CPUs it reserved
        opts = opts.replace(num_threads=max(1, int(cpus)))
    engine_options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": layout.num_gpus},
        "max_ongoing_requests": layout.max_ongoing_requests,
        "health_check_period_s": 5,
    }
    if layout.autoscaling_config is not None:
        engine_options["autoscaling_config"] = layout.autoscaling_config
    else:
        engine_options["num_replicas"] = layout.num_replicas
    router_cls = ROUTERS[layout.router]
    if router_cls is not None:
        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class=router_cls, request_router_kwargs=layout.router_kwargs
        )
    engine = serve.deployment(RadixEngine).options(**engine_options)
    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=layout.ingress_replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1024,
    )
    options = opts.to_dict()
    return ingress.bind(engine.bind(options), options)


def app_builder(args: dict[str, Any]) -> Any:
    """`serve run radixserve.ray.deployments:app_builder` / a config file's `import_path`.

    `args` (the config file's `args:`): `worker` (WorkerOptions fields, e.g. model,
    kv_cache_memory) and any `RayDeployment` field (num_replicas, num_cpus, router, ...).
    """
    args = dict(args)
    opts = WorkerOptions.from_dict(dict(args.pop("worker", {}) or {}))
    return build_app(opts, RayDeployment(**args))
