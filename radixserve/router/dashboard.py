"""`/dashboard` on the router: the server's page with one panel per worker.

Each panel polls `/v1/router/workers/{i}/cache/tree` and `.../dashboard/stats`, which this
module forwards to worker i's `/v1/cache/tree` and `/v1/dashboard/stats` (with the worker key,
else the viewer's own). The router's API-key check covers these routes like every `/v1` route,
and each worker decides, as when it is asked directly, whether its tree carries text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixserve.router.errors import error_response
from radixserve.router.worker import Worker
from radixserve.server.dashboard import add_static_routes

FORWARDED = {"cache/tree": "/v1/cache/tree", "dashboard/stats": "/v1/dashboard/stats"}


def add_router_dashboard(
    app: FastAPI,
    workers: Sequence[Worker],
    client: httpx.AsyncClient,
    headers: Callable[[Request], dict[str, str]],
    api_key: str | None,
) -> None:
    """Register `/dashboard` (a panel per worker) and the per-worker data routes on `app`;
    worker data is fetched with `client`, sending `headers(request)`."""
    config = {
        "title": f"radixserve router · {len(workers)} workers",
        "auth": bool(api_key),
        "panels": [
            {"name": f"worker {w.index} · {w.url}", "base": f"/v1/router/workers/{w.index}"}
            for w in workers
        ],
    }
    add_static_routes(app, config)

    @app.get("/v1/router/workers/{index}/{kind:path}")
    async def worker_data(index: int, kind: str, request: Request) -> Response:
        if kind not in FORWARDED or not 0 <= index < len(workers):
            return error_response(404, f"no such route: {request.url.path}", "not_found")
        url = workers[index].url + FORWARDED[kind]
        try:
            r = await client.get(
                url, params=request.query_params, headers=headers(request), timeout=30.0
            )
        except httpx.HTTPError as e:
            return error_response(502, f"worker {workers[index].url} failed: {type(e).__name__}")
        return Response(r.content, r.status_code, media_type="application/json")
