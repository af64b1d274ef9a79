"""`GET /dashboard`: a live page of the prefix cache, and the two JSON routes it polls.

- `/dashboard` and `/dashboard/static/*`: the page itself (HTML/JS/CSS shipped inside the
  package; no CDN, no build step). It holds no data, so it is served without the API key.
- `/dashboard/config.json`: the panels to draw (one here; one per worker on the router) and
  whether the data routes need the API key.
- `/v1/cache/tree?max_nodes=N[&token_ids=true]`: the radix tree (see `cache_tree.py`).
- `/v1/dashboard/stats`: engine counters, pool gauges and the TTFT histogram; the page turns
  differences between polls into rates, windowed hit ratio and TTFT quantiles.

The tree is copied under the cache's lock (`engine.cache_tree()`) in a worker thread. The copy
of a big tree holds that lock for a while, so copies are shared by every viewer and taken at
most once per `max(MIN_SNAPSHOT_INTERVAL_S, SNAPSHOT_DUTY * last copy time)`: the engine thread
waits on the dashboard less than 1/SNAPSHOT_DUTY of the time, however many pages are open.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from radixserve.cache import TreeSnapshot
from radixserve.server.cache_tree import DEFAULT_MAX_NODES, MAX_MAX_NODES, tree_json
from radixserve.server.errors import APIError

if TYPE_CHECKING:
    from radixserve.server.engine_api import ServedEngine
    from radixserve.server.metrics import ServerMetrics

MIN_SNAPSHOT_INTERVAL_S = 0.5
SNAPSHOT_DUTY = 20
STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


def static_text(name: str) -> str:
    """A file of the page, read from the installed package."""
    return (resources.files("radixserve.server") / "static" / name).read_text("utf-8")


def parse_max_nodes(request: Request) -> int:
    """The `max_nodes` query parameter, checked (400 on a bad value)."""
    raw = request.query_params.get("max_nodes")
    if raw is None:
        return DEFAULT_MAX_NODES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_MAX_NODES:
        raise APIError(
            400, f"max_nodes must be an integer in [1, {MAX_MAX_NODES}]", param="max_nodes"
        )
    return value


def add_static_routes(app: FastAPI, config: dict[str, Any]) -> None:
    """`/dashboard`, its static files and `/dashboard/config.json` (shared with the router)."""
    page = static_text("dashboard.html")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"no such file: {name}", code="not_found")
        return Response(static_text(name), media_type=STATIC_FILES[name])

    @app.get("/dashboard/config.json", include_in_schema=False)
    async def dashboard_config() -> JSONResponse:
        return JSONResponse(config)


class DashboardData:
    """The data routes' answers for one engine: shared, rate-limited tree copies and stats."""

    def __init__(self, engine: ServedEngine, metrics: ServerMetrics, show_text: bool) -> None:
        self.engine = engine
        self.metrics = metrics
        self.show_text = show_text
        self._snapshot: TreeSnapshot | None = None
        self._snapshot_cost = 0.0
        self._lock = asyncio.Lock()

    async def snapshot(self) -> TreeSnapshot | None:
        """A recent copy of the tree: reused while fresh, else taken in a worker thread."""
        async with self._lock:
            snap = self._snapshot
            interval = max(MIN_SNAPSHOT_INTERVAL_S, SNAPSHOT_DUTY * self._snapshot_cost)
            if snap is None or time.monotonic() - snap.taken_at >= interval:
                start = time.perf_counter()
                snap = await asyncio.to_thread(self.engine.cache_tree)
                self._snapshot_cost = time.perf_counter() - start
                self._snapshot = snap
            return snap

    async def tree(self, max_nodes: int, token_ids: bool = False) -> dict[str, Any]:
        """The `/v1/cache/tree` body."""
        snap = await self.snapshot()
        if snap is None:
            return {"object": "cache.tree", "enabled": False, "nodes": [], "top_prefixes": []}
        decode = self._decode if self.show_text else None
        body = await asyncio.to_thread(
            tree_json, snap, max_nodes, decode, time.monotonic(), token_ids
        )
        body["enabled"] = True
        return body

    def _decode(self, token_lists: list[list[int]]) -> list[str]:
        return self.engine.tokenizer.decode_batch(token_lists)

    def stats(self) -> dict[str, Any]:
        """The `/v1/dashboard/stats` body: cumulative counters and current gauges."""
        s = self.engine.stats()
        buckets: list[list[float | None]] = []  # [upper bound (None: +Inf), cumulative count]
        count = total = 0.0
        for metric in self.metrics.ttft.collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    buckets.append([le if le != float("inf") else None, sample.value])
                elif sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
        return {
            "object": "dashboard.stats",
            "time": time.time(),
            "requests": sum(s.requests_total.values()),
            "prompt_tokens": s.prompt_tokens_total,
            "generation_tokens": s.generation_tokens_total,
            "prefix_cache_queries": s.prefix_cache_queries_total,
            "prefix_cache_hits": s.prefix_cache_hits_total,
            "evicted_blocks": s.evicted_blocks_total,
            "preemptions": s.preemptions_total,
            "num_waiting": s.num_waiting,
            "num_running": s.num_running,
            "blocks": {
                "total": s.blocks_total,
                "free": s.blocks_free,
                "cached": s.blocks_cached,
                "locked": s.blocks_locked,
            },
            "ttft": {"buckets": buckets, "count": count, "sum": total},
        }


def add_dashboard(
    app: FastAPI,
    v1: APIRouter,
    engine: ServedEngine,
    metrics: ServerMetrics,
    api_key: str | None,
    show_text: bool,
) -> None:
    """Register the dashboard's routes; call before `app.include_router(v1)`.

    Text (token ids, detokenized runs, namespace names) is in the tree only without an API
    key or with `show_text` (`--dashboard-show-text`); otherwise token counts only.
    """
    data = DashboardData(engine, metrics, show_text=show_text or not api_key)
    config = {
        "title": f"radixserve · {engine.model_name}",
        "auth": bool(api_key),
        "panels": [{"name": engine.model_name, "base": "/v1"}],
    }
    add_static_routes(app, config)

    @v1.get("/cache/tree")
    async def cache_tree(request: Request) -> JSONResponse:
        with_ids = request.query_params.get("token_ids", "").lower() in ("1", "true")
        return JSONResponse(await data.tree(parse_max_nodes(request), with_ids))

    @v1.get("/dashboard/stats")
    async def dashboard_stats() -> JSONResponse:
        return JSONResponse(data.stats())
