"""The FastAPI app: routes, API-key auth, and the wiring of serving, metrics and cache events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.encoders import jsonable_encoder
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixserve import __version__
from radixserve.server import auth
from radixserve.server.bridge import EngineBridge
from radixserve.server.cache_events import CacheEventHub
from radixserve.server.dashboard import add_dashboard
from radixserve.server.errors import APIError, install_error_handlers
from radixserve.server.lifecycle import Drain
from radixserve.server.metrics import CONTENT_TYPE, ResponseCounter, ServerMetrics
from radixserve.server.openapi import install_openapi
from radixserve.server.protocol import MAX_BODY_BYTES
from radixserve.server.serving import DEFAULT_MAX_TOKENS, SSE_HEADERS, OpenAIServing

if TYPE_CHECKING:
    from radixserve.server.engine_api import ServedEngine


def _auth_dependency(api_keys: list[str]) -> Callable[[Request], Awaitable[None]]:
    keys = auth.ApiKeys(api_keys)

    async def require_api_key(request: Request) -> None:
        if not keys.allow(request):
            raise APIError(401, auth.MESSAGE, code=auth.CODE, headers=auth.CHALLENGE)

    return require_api_key


def build_app(
    engine: ServedEngine,
    api_key: str | None = None,
    served_model_name: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    max_body_bytes: int = MAX_BODY_BYTES,
    bridge_factory: Callable[[ServerMetrics], EngineBridge] | None = None,
    cache_events: bool = True,
    dashboard_show_text: bool = False,
    api_key_tiers: dict[str, int] | None = None,
    disaggregation_mode: str = "null",
    disaggregation_transfer_backend: str = "auto",
) -> FastAPI:
    """An OpenAI-compatible app over a started engine; the caller owns the engine.

    `bridge_factory(metrics)` replaces the in-process bridge (the Ray ingress passes one that
    submits to engine replicas); without `cache_events` there is no /v1/cache/events route.
    With `api_key_tiers`, those keys are accepted too, and a request's cache-retention
    tier (its `priority`) is its key's tier. `disaggregation_mode` "prefill" adds POST
    /v1/disaggregation/prefill, "decode" takes requests' K/V from the prefill worker their
    `kv_transfer_params` name (server/disagg.py; an engine in this process only), through
    `disaggregation_transfer_backend`.
    """
    model_name = served_model_name or engine.model_name
    metrics = ServerMetrics(engine)
    if bridge_factory is None:
        bridge = EngineBridge(engine, observer=metrics)
    else:
        bridge = bridge_factory(metrics)
    serving = OpenAIServing(engine, bridge, [model_name], default_max_tokens, max_body_bytes)
    serving.api_key_tiers = dict(api_key_tiers or {})
    hub = CacheEventHub(engine)

    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.cache_events = hub
    install_error_handlers(app)
    app.add_middleware(ResponseCounter, metrics=metrics)
    app.add_middleware(Drain)  # outermost: refuses new requests once the server drains

    keys = ([api_key] if api_key else []) + list(api_key_tiers or {})
    deps = [Depends(_auth_dependency(keys))] if keys else []
    v1 = APIRouter(prefix="/v1", dependencies=deps)
    _add_openai_routes(v1, serving, engine, model_name)
    _add_cache_routes(v1, engine, hub if cache_events else None)
    _add_disaggregation(
        app, v1, serving, engine, metrics, disaggregation_mode, api_key,
        disaggregation_transfer_backend,
    )  # fmt: skip
    # The cache dashboard: /dashboard (page), /v1/cache/tree, /v1/dashboard/stats.
    add_dashboard(app, v1, engine, metrics, api_key, show_text=dashboard_show_text)
    app.include_router(v1)
    if engine.can_reset_prefix_cache:  # not on the Ray ingress: its replicas' caches
        _add_reset_route(app, engine, deps)
    _add_service_routes(app, engine, metrics)
    return app


def _add_openai_routes(
    v1: APIRouter, serving: OpenAIServing, engine: ServedEngine, model_name: str
) -> None:
    """/v1/chat/completions, /v1/completions and /v1/models."""
    created = int(time.time())

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @v1.get("/models")
    async def models() -> JSONResponse:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "radixserve",
            "max_model_len": engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})


def _add_disaggregation(
    app: FastAPI, v1: APIRouter, serving: OpenAIServing, engine: ServedEngine,
    metrics: ServerMetrics, mode: str, api_key: str | None, backend: str = "auto",
) -> None:  # fmt: skip
    """The prefill route, or a decode worker's handoffs (server/disagg.py)."""
    if mode == "null":
        return
    from radixserve.engine.engine import LLMEngine
    from radixserve.errors import ConfigError
    from radixserve.server.disagg import DecodeRole, PrefillRole

    if not isinstance(engine, LLMEngine):
        raise ConfigError("--disaggregation-mode needs the engine in this process")
    if mode == "prefill":
        role = PrefillRole(engine)
        app.router.on_shutdown.append(role.close)

        @v1.post("/disaggregation/prefill", include_in_schema=False)
        async def disaggregation_prefill(request: Request) -> Response:
            return await role.prefill(request)

        @v1.post("/disaggregation/write_back", include_in_schema=False)
        async def disaggregation_write_back(request: Request) -> Response:
            return await role.write_back(request)

    else:
        serving.decode = DecodeRole(engine, metrics.registry, api_key, backend=backend)
        app.router.on_shutdown.append(serving.decode.close)


def _add_cache_routes(v1: APIRouter, engine: ServedEngine, hub: CacheEventHub | None) -> None:
    """/v1/cache/stats, and /v1/cache/events where `hub` streams them."""

    @v1.get("/cache/stats")
    async def cache_stats() -> JSONResponse:
        return JSONResponse(jsonable_encoder(engine.cache_stats()))

    if hub is not None:

        @v1.get("/cache/events")
        async def cache_event_stream() -> StreamingResponse:
            return StreamingResponse(
                hub.stream(), media_type="text/event-stream", headers=SSE_HEADERS
            )


def _add_reset_route(app: FastAPI, engine: ServedEngine, deps: list[Any]) -> None:
    """POST /reset_prefix_cache (vLLM's route; KV events hear of it as one clear)."""

    @app.post("/reset_prefix_cache", dependencies=deps)
    async def reset_prefix_cache() -> JSONResponse:
        freed = await asyncio.to_thread(engine.reset_prefix_cache)
        return JSONResponse({"status": "ok", "freed_blocks": freed})


def _add_service_routes(app: FastAPI, engine: ServedEngine, metrics: ServerMetrics) -> None:
    """/health, /metrics and /version: no API key needed."""

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.is_alive():
            return JSONResponse({"status": "ok"})
        return APIError(503, "the engine is not running", code="engine_dead").response()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:  # as vLLM: the radixserve version
        return JSONResponse({"version": __version__})
