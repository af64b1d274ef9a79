"""The router's OpenAI-compatible HTTP front: a proxy that retries and never trusts upstream."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve import __version__
from radixserve.router.balancer import Balancer, Prompt, Route
from radixserve.router.dashboard import add_router_dashboard
from radixserve.router.errors import error_response
from radixserve.router.metrics import RouterMetrics
from radixserve.router.prompt import normalize_body
from radixserve.server import auth

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # the first try and one retry on another worker
# A decode worker's error code when the prefill worker it was told to use failed: server/
# disagg.py's PREFILL_UNAVAILABLE (not imported: that module brings torch into the router)
PREFILL_UNAVAILABLE = "prefill_unavailable"
# What a request to a worker can raise when the worker is gone. httpcore may raise
# AttributeError ("'NoneType' object has no attribute 'getpeername'") instead of an
# httpx error on a pooled connection whose worker was killed: seen in the kill -9 fault test,
# where it surfaced as a 500 instead of a retry.
TRANSPORT_ERRORS = (httpx.HTTPError, OSError, AttributeError)


@dataclass
class Failure:
    """An attempt that failed before any byte reached the client (so it may be retried)."""

    status: int
    message: str
    retry: bool = True
    retry_after: str | None = None  # the worker's Retry-After (e.g. its queue was full)
    code: str | None = None  # the worker's own error code, if it answered one

    def response(self) -> Response:
        """What the client gets when no attempt succeeded."""
        resp = error_response(self.status, self.message)
        if self.retry_after:
            resp.headers["retry-after"] = self.retry_after
        return resp


def _upstream_error(content: bytes) -> tuple[str, str | None]:
    """The message of a worker's error body (OpenAI-style or not), shortened, and its
    OpenAI-style error code if it has one."""
    try:
        obj = json.loads(content)
        err = obj.get("error") if isinstance(obj, dict) else None
        msg = err.get("message") if isinstance(err, dict) else (err or obj.get("detail"))
        code = err.get("code") if isinstance(err, dict) else None
        if msg:
            return str(msg)[:500], code if isinstance(code, str) else None
    except (ValueError, AttributeError):
        pass
    return content[:200].decode("utf-8", "replace"), None


class ProxyStream(StreamingResponse):
    """A streaming response that runs `cleanup` however the stream ends (even unstarted)."""

    def __init__(
        self, body: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kwargs: Any
    ) -> None:
        super().__init__(body, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def _usage_cached_tokens(obj: Any) -> int:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) else 0


def _stream_cached_tokens(tail: bytes) -> int:
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                n = _usage_cached_tokens(json.loads(line[5:]))
            except ValueError:
                continue
            if n:
                return n
    return 0


class Proxy:
    """Sends each request to the balancer's pick, retrying once elsewhere if it fails early."""

    def __init__(
        self,
        balancer: Balancer,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        worker_api_key: str | None = None,
        normalize: bool = False,
        prefill: Balancer | None = None,
    ) -> None:
        self.balancer = balancer
        self.prefill = prefill  # --pd-disaggregation: the prefill workers
        self.client = client
        self.metrics = metrics
        self.worker_api_key = worker_api_key
        self.normalize = normalize

    def headers(self, request: Request) -> dict[str, str]:
        """Headers for the worker: JSON, and the worker key or else the client's own."""
        h = {"content-type": "application/json", "accept": request.headers.get("accept", "*/*")}
        if self.worker_api_key:
            h["authorization"] = f"Bearer {self.worker_api_key}"
        elif "authorization" in request.headers:
            h["authorization"] = request.headers["authorization"]
        if "x-request-id" in request.headers:
            h["x-request-id"] = request.headers["x-request-id"]
        return h

    async def generate(self, request: Request, path: str, chat: bool) -> Response:
        """POST /v1/chat/completions or /v1/completions through the chosen worker."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return error_response(
                400, "the request body must be a JSON object", "invalid_request_error"
            )
        if self.normalize:
            body = normalize_body(body, chat)
            raw = json.dumps(body).encode()
        prompt = await self.balancer.prompt_of(body, chat)
        send = self._stream if body.get("stream") else self._once
        headers = self.headers(request)
        if self.prefill is None:
            return await self._with_retry(prompt, lambda route: send(route, path, raw, headers))
        prefill, tried = self.prefill, set[int]()

        async def attempt(route: Route) -> Response | Failure:
            """The decode worker `route` names, told which prefill worker to take the K/V
            from: the policy's pick, preferring prefill workers this request has not tried;
            while the decode worker reports that one failed, the next."""
            result: Response | Failure = Failure(503, "no healthy prefill worker is available")
            here: set[int] = set()  # prefill workers tried with this decode worker
            while True:
                healthy = {w.index for w in prefill.healthy()} - here
                if not healthy:
                    return result
                exclude = tried | here if healthy - tried else here
                p = prefill.pick(prompt, frozenset(exclude))
                here.add(p.worker.index)
                tried.add(p.worker.index)
                transfer = {"kv_transfer_params": {"prefill_url": p.worker.url}}
                raw_pd = json.dumps({**body, **transfer}).encode()
                result = await send(route, path, raw_pd, headers)
                if not (isinstance(result, Failure) and result.code == PREFILL_UNAVAILABLE):
                    return result

        return await self._with_retry(prompt, attempt)

    async def get(self, request: Request, path: str) -> Response:
        """A GET (e.g. /v1/models) answered by any healthy worker."""
        headers = self.headers(request)
        return await self._with_retry(
            Prompt(None, None), lambda r: self._get(r, path, headers), record=False
        )

    async def _with_retry(
        self,
        prompt: Prompt,
        attempt: Callable[[Route], Awaitable[Response | Failure]],
        record: bool = True,
    ) -> Response:
        tried: set[int] = set()
        failure: Failure | None = None
        for n in range(MAX_ATTEMPTS):
            healthy = [w for w in self.balancer.healthy() if w.index not in tried]
            if not healthy:
                break
            route = self.balancer.pick(prompt, frozenset(tried), record)
            tried.add(route.worker.index)
            if n and record:
                self.metrics.retries.inc()
                log.info("retrying on %s after: %s", route.worker.name, failure and failure.message)
            result = await attempt(route)
            if isinstance(result, Response):
                result.headers["x-radixserve-worker"] = str(route.worker.index)
                result.headers["x-radixserve-route"] = route.decision.reason
                return result
            failure = result
            if not result.retry:
                break
        if failure is None:
            return error_response(503, "no healthy worker is available", "service_unavailable")
        return failure.response()

    def _failed(self, route: Route, e: Exception) -> Failure:
        w = route.worker
        kind = type(e).__name__
        self.metrics.requests.labels(w.name, "error").inc()
        self.metrics.upstream_errors.labels(w.name, kind).inc()
        w.connection_failed(e)
        if isinstance(e, httpx.TimeoutException):  # slow, not broken: retrying doubles the wait
            return Failure(504, f"worker {w.url} timed out ({kind})", retry=False)
        return Failure(502, f"worker {w.url} failed: {kind}: {e}")

    def _bad_status(self, route: Route, r: httpx.Response, content: bytes) -> Failure:
        status = r.status_code
        w = route.worker
        self.metrics.requests.labels(w.name, "error").inc()
        self.metrics.upstream_errors.labels(w.name, f"http_{status}").inc()
        message, code = _upstream_error(content)
        return Failure(
            status if status in (502, 503, 504) else 502,
            f"worker {w.url} answered HTTP {status}: {message}",
            retry_after=r.headers.get("retry-after"),
            code=code,
        )

    async def _once(
        self, route: Route, path: str, raw: bytes, headers: dict[str, str]
    ) -> Response | Failure:
        w = route.worker
        pending = route.begin()
        try:
            r = await self.client.post(w.url + path, content=raw, headers=headers)
        except TRANSPORT_ERRORS as e:
            return self._failed(route, e)
        finally:
            w.end(pending)
        if r.status_code >= 500:
            return self._bad_status(route, r, r.content)
        if r.status_code == 200:
            try:
                obj = json.loads(r.content)
            except ValueError:
                self.metrics.upstream_errors.labels(w.name, "bad_json").inc()
                return Failure(502, f"worker {w.url} answered with invalid JSON")
            self.metrics.cached_tokens.labels(w.name).inc(_usage_cached_tokens(obj))
        self.metrics.requests.labels(w.name, "ok").inc()
        media = r.headers.get("content-type", "application/json")
        return Response(r.content, r.status_code, media_type=media)

    async def _get(self, route: Route, path: str, headers: dict[str, str]) -> Response | Failure:
        w = route.worker
        try:
            r = await self.client.get(w.url + path, headers=headers, timeout=10.0)
        except TRANSPORT_ERRORS as e:
            return self._failed(route, e)
        if r.status_code >= 500:
            return self._bad_status(route, r, r.content)
        media = r.headers.get("content-type", "application/json")
        return Response(r.content, r.status_code, media_type=media)

    async def _stream(
        self, route: Route, path: str, raw: bytes, headers: dict[str, str]
    ) -> Response | Failure:
        w = route.worker
        pending = route.begin()
        req = self.client.build_request("POST", w.url + path, content=raw, headers=headers)
        upstream: httpx.Response | None = None
        try:
            upstream = await self.client.send(req, stream=True)
            if upstream.status_code != 200:
                content = await upstream.aread()
                await upstream.aclose()
                w.end(pending)
                if upstream.status_code >= 500:
                    return self._bad_status(route, upstream, content)
                media = upstream.headers.get("content-type", "application/json")
                return Response(content, upstream.status_code, media_type=media)
            chunks = upstream.aiter_raw()
            first = await anext(chunks)  # the retry window closes with the first byte sent
        except (*TRANSPORT_ERRORS, StopAsyncIteration) as e:
            if upstream is not None:
                await upstream.aclose()
            w.end(pending)
            if isinstance(e, StopAsyncIteration):
                self.metrics.upstream_errors.labels(w.name, "empty_stream").inc()
                return Failure(502, f"worker {w.url} closed the stream without data")
            return self._failed(route, e)
        resp = upstream
        closed = False

        async def cleanup() -> None:
            nonlocal closed
            if not closed:
                closed = True
                await resp.aclose()
                w.end(pending)

        async def body() -> AsyncIterator[bytes]:
            tail = first[-16384:]
            yield first
            try:
                async for chunk in chunks:
                    tail = (tail + chunk)[-16384:]
                    yield chunk
                self.metrics.requests.labels(w.name, "ok").inc()
                self.metrics.cached_tokens.labels(w.name).inc(_stream_cached_tokens(tail))
            except TRANSPORT_ERRORS as e:  # too late to retry: tell the client in-band
                kind = type(e).__name__
                log.warning("stream from %s broke: %s: %s", w.name, kind, e)
                self.metrics.requests.labels(w.name, "error").inc()
                self.metrics.upstream_errors.labels(w.name, kind).inc()
                w.connection_failed(e)
                err = {
                    "error": {
                        "message": f"worker {w.url} failed mid-stream: {kind}: {e}",
                        "type": "upstream_error",
                        "param": None,
                        "code": 502,
                    }
                }
                yield f"data: {json.dumps(err)}\n\n".encode()
            finally:
                await cleanup()

        media = upstream.headers.get("content-type", "text/event-stream")
        return ProxyStream(body(), cleanup, media_type=media, headers={"cache-control": "no-cache"})


def build_app(
    balancer: Balancer,
    client: httpx.AsyncClient,
    metrics: RouterMetrics,
    api_key: str | None = None,
    worker_api_key: str | None = None,
    normalize: bool = False,
    prefill: Balancer | None = None,
) -> FastAPI:
    """The router app; its lifespan starts and stops the workers' health and event loops.
    With `prefill` (--pd-disaggregation), `balancer`'s workers are the decode workers and
    each request names one of `prefill`'s."""
    proxy = Proxy(balancer, client, metrics, worker_api_key or api_key, normalize, prefill)
    balancers = [balancer] if prefill is None else [balancer, prefill]
    app = FastAPI(title="radixserve router", lifespan=_lifespan(balancers, client))
    app.state.balancer = balancer
    app.state.metrics = metrics
    _add_key_check(app, auth.ApiKeys([api_key] if api_key else []))
    _add_openai_routes(app, proxy)
    _add_status_routes(app, balancer, metrics, prefill)
    _add_router_routes(app, balancer)
    # The cache dashboard, one panel per worker: /dashboard, /v1/router/workers/{i}/...
    add_router_dashboard(app, proxy.balancer.workers, proxy.client, proxy.headers, api_key)
    return app


def _lifespan(
    balancers: list[Balancer], client: httpx.AsyncClient
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Starts the balancers' loops with the app; stops them and closes `client` after it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for balancer in balancers:
            await balancer.start()
        try:
            yield
        finally:
            for balancer in balancers:
                await balancer.stop()
            await client.aclose()

    return lifespan


def _add_key_check(app: FastAPI, keys: auth.ApiKeys) -> None:
    """Answer 401 to a /v1/ request without one of `keys` (no check when there are none)."""

    @app.middleware("http")
    async def check_key(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if keys and request.url.path.startswith("/v1/") and not keys.allow(request):
            response = error_response(401, auth.MESSAGE, auth.CODE)
            response.headers.update(auth.CHALLENGE)
            return response
        return await call_next(request)


def _add_openai_routes(app: FastAPI, proxy: Proxy) -> None:
    """The OpenAI routes, passed through `proxy` to a worker."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.generate(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.generate(request, "/v1/completions", chat=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.get(request, "/v1/models")


def _add_status_routes(
    app: FastAPI, balancer: Balancer, metrics: RouterMetrics, prefill: Balancer | None
) -> None:
    """/health (503 when no worker is healthy; with --pd-disaggregation, no decode or no
    prefill worker), /metrics and /version."""

    @app.get("/health")
    async def health() -> Response:
        healthy = bool(balancer.healthy()) and (prefill is None or bool(prefill.healthy()))
        body: dict[str, Any] = {
            "status": "ok" if healthy else "unavailable",
            "policy": balancer.policy,
            "workers": [w.state() for w in balancer.workers],
        }
        if prefill is not None:  # `workers` are the decode workers
            body["prefill_workers"] = [w.state() for w in prefill.workers]
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> Response:  # as vLLM: the radixserve version, no key needed
        return JSONResponse({"version": __version__})


def _add_router_routes(app: FastAPI, balancer: Balancer) -> None:
    """/v1/router/workers (each worker's state) and /v1/router/tree (each worker's mirror)."""

    @app.get("/v1/router/workers")
    async def workers() -> Response:
        return JSONResponse({"workers": [w.state() for w in balancer.workers]})

    @app.get("/v1/router/tree")
    async def tree() -> Response:
        out = []
        for w in balancer.workers:
            paths = [{"namespace": ns, "token_ids": list(t)} for ns, t in w.trie.paths()]
            out.append(
                {
                    "index": w.index,
                    "url": w.url,
                    "healthy": w.healthy,
                    "cache_events_live": w.events_live,
                    "paths": paths,
                }
            )
        return JSONResponse({"workers": out})
