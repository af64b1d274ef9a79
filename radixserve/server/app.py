"""The FastAPI app: routes, API-key auth, and the wiring of serving, metrics and cache events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

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
    from radixserve.engine.engine import LLMEngine


def _auth_dependency(api_keys: list[str]) -> Callable[[Request], Awaitable[None]]:
    keys = auth.ApiKeys(api_keys)

    async def require_api_key(request: Request) -> None:
        if not keys.allow(request):
            raise APIError(401, auth.MESSAGE, code=auth.CODE, headers=auth.CHALLENGE)

    return require_api_key


def build_app(
    engine: LLMEngine,
    api_key: str | None = None,
    served_model_name: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    max_body_bytes: int = MAX_BODY_BYTES,
    bridge_factory: Callable[[ServerMetrics], EngineBridge] | None = None,
    cache_events: bool = True,
    dashboard_show_text: bool = False,
    api_key_tiers: dict[str, int] | None = None,
) -> FastAPI:
    """An OpenAI-compatible app over a started `LLMEngine`; the caller owns the engine.

    `bridge_factory(metrics)` replaces the in-process bridge (the Ray ingress passes one that
    submits to engine replicas); without `cache_events` there is no /v1/cache/events route.
    With `api_key_tiers`, those keys are accepted too, and a request's cache-retention
    tier (its `priority`) is its key's tier.
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
    created = int(time.time())

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

    @v1.get("/cache/stats")
    async def cache_stats() -> JSONResponse:
        return JSONResponse(jsonable_encoder(engine.cache_stats()))

    if cache_events:

        @v1.get("/cache/events")
        async def cache_event_stream() -> StreamingResponse:
            return StreamingResponse(
                hub.stream(), media_type="text/event-stream", headers=SSE_HEADERS
            )

    # The cache dashboard: /dashboard (page), /v1/cache/tree, /v1/dashboard/stats.
    add_dashboard(app, v1, engine, metrics, api_key, show_text=dashboard_show_text)

    app.include_router(v1)

    if hasattr(engine, "reset_prefix_cache"):  # the Ray ingress's remote engine has none

        @app.post("/reset_prefix_cache", dependencies=deps)
        async def reset_prefix_cache() -> JSONResponse:  # vLLM's route; KV events: cleared
            freed = await asyncio.to_thread(engine.reset_prefix_cache)
            return JSONResponse({"status": "ok", "freed_blocks": freed})

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.is_alive():
            return JSONResponse({"status": "ok"})
        return APIError(503, "the engine is not running", code="engine_dead").response()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:  # as vLLM: the radixserve version, no key needed
        return JSONResponse({"version": __version__})

    return app
