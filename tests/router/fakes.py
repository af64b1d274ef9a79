"""In-process fake workers (FastAPI on uvicorn threads) that speak the server's HTTP contract.

A fake worker "caches" every prompt it answers in a real `RadixCache` with a small pool, so
evictions happen and its `/v1/cache/events` stream carries real insert/evict events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixserve.cache import CacheEvent
from radixserve.router.main import add_route_args, build_router_app
from radixserve.router.trie import WorkerTrie
from radixserve.server.cache_tree import tree_json
from tests.support import free_port, wait_for

BLOCK_SIZE = 4


class CharTokenizer:
    """One token per character; a chat is rendered as `<role>content` per message."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: Any) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>")


@dataclass
class FakeState:
    """What a test can steer and inspect on a fake worker."""

    name: str
    num_blocks: int = 64
    fail_next: list[int] = field(default_factory=list)  # HTTP statuses to answer next
    bad_json: bool = False
    send_num_tokens: bool = True  # include num_tokens in evict events
    api_key: str | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth_seen: list[str | None] = field(default_factory=list)
    delay: float = 0.0
    bad_events: int = 0  # event streams that start with a malformed event
    query_tokens: int = 0  # prompt tokens looked up (for /v1/dashboard/stats)
    hit_tokens: int = 0


def fake_worker_app(state: FakeState) -> FastAPI:
    """A FastAPI app imitating `radixserve serve` closely enough for the router."""
    app = FastAPI()
    trie = WorkerTrie(BLOCK_SIZE, state.num_blocks)
    subscribers: set[asyncio.Queue[dict[str, Any]]] = set()

    def on_event(e: CacheEvent) -> None:
        data: dict[str, Any] = {
            "type": e.kind,
            "namespace": e.namespace,
            "token_ids": list(e.token_ids),
        }
        if state.send_num_tokens:
            data["num_tokens"] = e.num_tokens
        for q in subscribers:
            q.put_nowait(data)

    def listen() -> None:
        trie.cache.add_listener(on_event)

    listen()

    def reset() -> None:  # trie.clear() builds a new cache: listen to it too
        trie.clear()
        listen()

    app.state.fake = state
    app.state.trie = trie
    app.state.reset = reset
    _add_status_routes(app, state, trie)
    _add_events_route(app, state, trie, subscribers)
    _add_chat_route(app, state, trie)
    return app


def _authorized(state: FakeState, request: Request) -> bool:
    return not state.api_key or request.headers.get("authorization") == f"Bearer {state.api_key}"


def _add_status_routes(app: FastAPI, state: FakeState, trie: WorkerTrie) -> None:
    """/health, /v1/models, the cache's stats and tree, and the dashboard's stats."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.get("/v1/cache/stats")
    async def stats() -> dict[str, int]:
        return {
            "block_size": BLOCK_SIZE,
            "cached_blocks": trie.num_blocks,
            "total_blocks": state.num_blocks,
        }

    @app.get("/v1/cache/tree")
    async def cache_tree(request: Request) -> Response:
        if not _authorized(state, request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        max_nodes = int(request.query_params.get("max_nodes", "100"))
        body = tree_json(trie.cache.snapshot(), max_nodes, None, time.monotonic())
        return JSONResponse({**body, "worker": state.name})

    @app.get("/v1/dashboard/stats")
    async def dashboard_stats() -> dict[str, Any]:
        used = trie.num_blocks
        return {
            "object": "dashboard.stats",
            "worker": state.name,
            "time": time.time(),
            "requests": len(state.bodies),
            "prefix_cache_queries": state.query_tokens,
            "prefix_cache_hits": state.hit_tokens,
            "evicted_blocks": 0,
            "preemptions": 0,
            "blocks": {
                "total": state.num_blocks,
                "free": state.num_blocks - used,
                "cached": used,
                "locked": 0,
            },
            "ttft": {"buckets": [[None, 0]], "count": 0, "sum": 0.0},
        }


def _add_events_route(
    app: FastAPI,
    state: FakeState,
    trie: WorkerTrie,
    subscribers: set[asyncio.Queue[dict[str, Any]]],
) -> None:
    """/v1/cache/events: a snapshot of the cached paths, then each cache event."""

    @app.get("/v1/cache/events")
    async def events() -> StreamingResponse:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        subscribers.add(q)

        async def gen() -> AsyncIterator[bytes]:
            try:
                if state.bad_events:
                    state.bad_events -= 1
                    yield b'data: {"type": "insert"}\n\n'
                paths = [{"namespace": ns, "token_ids": list(t)} for ns, t in trie.paths()]
                yield (
                    b"data: " + json.dumps({"type": "snapshot", "paths": paths}).encode() + b"\n\n"
                )
                while True:
                    item = await q.get()
                    yield b"data: " + json.dumps(item).encode() + b"\n\n"
            finally:
                subscribers.discard(q)

        return StreamingResponse(gen(), media_type="text/event-stream")


def _add_chat_route(app: FastAPI, state: FakeState, trie: WorkerTrie) -> None:
    """/v1/chat/completions: the failures the test asked for, else "ok" with the prompt's
    cached tokens in its usage (the prompt then cached)."""
    tok = CharTokenizer()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        state.auth_seen.append(request.headers.get("authorization"))
        if not _authorized(state, request):
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        if state.fail_next:
            status = state.fail_next.pop(0)
            headers = {"retry-after": "1"} if status == 503 else None
            body = {"error": {"message": f"{state.name} says {status}"}}
            return JSONResponse(body, status, headers=headers)
        if state.bad_json:
            return Response(b"<html>oops", media_type="application/json")
        body = await request.json()
        state.bodies.append(body)
        if state.delay:
            await asyncio.sleep(state.delay)
        ns = body.get("cache_salt")
        ids = tok.apply_chat_template(body["messages"])
        cached = trie.match(ids, ns)
        state.query_tokens += len(ids)
        state.hit_tokens += cached
        trie.insert(ids, ns)
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": 2,
            "total_tokens": len(ids) + 2,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if body.get("stream"):
            return StreamingResponse(_ok_chunks(usage), media_type="text/event-stream")
        return JSONResponse(
            {
                "id": "x",
                "object": "chat.completion",
                "model": "fake",
                "worker": state.name,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "length",
                        "message": {"role": "assistant", "content": "ok"},
                    }
                ],
                "usage": usage,
            }
        )


async def _ok_chunks(usage: dict[str, Any]) -> AsyncIterator[bytes]:
    """The streamed answer "ok", then the usage chunk and [DONE]."""
    for piece in ("o", "k"):
        chunk = {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": piece}}],
        }
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    last = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
    yield b"data: " + json.dumps(last).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


class ServerThread:
    """A uvicorn server for `app` on a free loopback port, in a daemon thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> ServerThread:
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        server, thread = self.server, self.thread
        wait_for(
            lambda: server.started or not thread.is_alive(), 20, f"uvicorn on {self.url}", 0.02
        )
        if not server.started:
            raise RuntimeError(f"the server thread on {self.url} ended without starting")
        return self

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(10)
        self.server = self.thread = None


class FakeCluster:
    """Fake workers (in-process) and a real router app in front of them, all on loopback."""

    def __init__(self, n: int = 2, route_flags: tuple[str, ...] = (), **fake: Any) -> None:
        self.states = [FakeState(name=f"w{i}", **fake) for i in range(n)]
        self.apps = [fake_worker_app(s) for s in self.states]
        self.workers = [ServerThread(a).start() for a in self.apps]
        parser = argparse.ArgumentParser()
        add_route_args(parser)
        argv = [x for w in self.workers for x in ("--worker", w.url)]
        args = parser.parse_args([*argv, "--health-interval", "0.2", *route_flags])
        self.app = build_router_app(args, tokenizer=CharTokenizer())
        self.router = ServerThread(self.app).start()
        self.http = httpx.Client(base_url=self.router.url, timeout=10)
        wait_for(lambda: all(w.healthy for w in self.balancer.workers), what="workers up")

    @property
    def balancer(self) -> Any:
        return self.app.state.balancer

    def chat(self, content: str, **extra: Any) -> httpx.Response:
        body = {"model": "fake", "messages": [{"role": "user", "content": content}], **extra}
        return self.http.post("/v1/chat/completions", json=body, headers=extra.pop("headers", {}))

    def close(self) -> None:
        self.http.close()
        self.router.stop()
        for w in self.workers:
            w.stop()
