"""A streaming OpenAI-compatible HTTP client that times each request (loopback targets only)."""

from __future__ import annotations

import ipaddress
import json
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from radixserve.bench.report import RequestRecord
from radixserve.bench.workloads import RequestSpec

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


class NotLoopbackError(ValueError):
    """The bench only talks to servers on this machine."""


def check_loopback(url: str) -> str:
    """Return `url` without a trailing slash; raise NotLoopbackError unless it is loopback."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NotLoopbackError(f"{url!r} is not an http(s) URL")
    host = parts.hostname
    if host.lower() not in LOOPBACK_NAMES:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise NotLoopbackError(
                f"refusing {url!r}: radixserve bench only targets loopback addresses "
                "(127.0.0.0/8, ::1, localhost)"
            )
    return url.rstrip("/")


def make_client(api_key: str | None = None, timeout: float = 600.0) -> httpx.AsyncClient:
    """An async HTTP client for the bench (no proxies from the environment)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(timeout, connect=10.0),
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024),
        trust_env=False,
    )


async def fetch_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id the server lists at /v1/models."""
    r = await client.get(f"{base_url}/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


def _chunk_text(chunk: dict[str, Any]) -> tuple[str, str | None, list[dict[str, Any]]]:
    """A chunk's text, finish reason and tool-call deltas (of its first choice)."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", None, []
    c = choices[0]
    delta = c.get("delta")
    text = (delta or {}).get("content") if delta is not None else c.get("text")
    return text or "", c.get("finish_reason"), (delta or {}).get("tool_calls") or []


def _merge_call_deltas(calls: dict[int, dict[str, Any]], deltas: list[dict[str, Any]]) -> str:
    """Add streamed tool-call deltas to `calls` (by index) as an OpenAI client does; returns
    the name and argument text they carried (it counts as output text for the timings)."""
    added = ""
    for d in deltas:
        call = calls.setdefault(
            int(d.get("index", 0)),
            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
        )
        call["id"] = d.get("id") or call["id"]
        fn = d.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
        added += (fn.get("name") or "") + (fn.get("arguments") or "")
    return added


def _read_drafts(rec: RequestRecord, details: Any) -> None:
    """Speculative decoding's counts from a usage chunk's `completion_tokens_details`
    (OpenAI's Predicted Outputs fields: drafted = accepted + rejected prediction tokens);
    the record keeps None when neither field is there."""
    if not isinstance(details, dict):
        return
    accepted = details.get("accepted_prediction_tokens")
    rejected = details.get("rejected_prediction_tokens")
    if accepted is None and rejected is None:
        return
    rec.accepted_tokens = int(accepted or 0)
    rec.draft_tokens = rec.accepted_tokens + int(rejected or 0)


def _tool_choice(body: dict[str, Any]) -> str | None:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if body.get("tools") else None
    return choice if isinstance(choice, str) else "named"


async def send_request(
    client: httpx.AsyncClient,
    base_url: str,
    spec: RequestSpec,
    body: dict[str, Any],
    t0: float,
) -> RequestRecord:
    """Stream one request and time it: TTFT is the first chunk that carries text (content or a
    tool call's name or arguments) or a finish reason (role-only chunks do not count);
    inter-token latencies are the gaps between text chunks; token counts come from the usage
    chunk, and so do speculative decoding's drafted and accepted tokens (its
    completion_tokens_details); streamed tool calls are put together in record.tool_calls.
    `t0` (time.perf_counter()) is the start of the run; errors land in record.error."""
    start = time.perf_counter()
    rec = RequestRecord(spec.id, spec.session_id, spec.turn, start - t0)
    rec.tool_choice = _tool_choice(body)
    parts: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    last: float | None = None
    try:
        async with client.stream("POST", f"{base_url}{spec.path}", json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                rec.error = f"HTTP {resp.status_code}: {detail}"
                rec.e2e = time.perf_counter() - start
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    rec.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    break
                text, finish, call_deltas = _chunk_text(chunk)
                call_text = _merge_call_deltas(calls, call_deltas)
                if rec.ttft is None and (text or call_text or finish):  # lone finish: EOS first
                    rec.ttft = now - start
                if text or call_text:
                    if last is not None:
                        rec.itl.append(now - last)
                    last = now
                    rec.chunks += 1
                    parts.append(text)  # content only; call text is in `calls`
                if finish:
                    rec.finish_reason = finish
                timings = chunk.get("timings")  # llama.cpp's server: cache_n prompt tokens hit
                if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
                    rec.cached_tokens = rec.cached_tokens or timings["cache_n"]
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens") or rec.cached_tokens or 0
                    _read_drafts(rec, usage.get("completion_tokens_details"))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.e2e = time.perf_counter() - start
    rec.text = "".join(parts)
    rec.tool_calls = [calls[i] for i in sorted(calls)]
    if rec.error is None and rec.completion_tokens is None:
        rec.completion_tokens = rec.chunks  # server sent no usage chunk: count text chunks
    return rec


async def wait_healthy(
    client: httpx.AsyncClient, base_url: str, timeout: float, proc: Any = None
) -> None:
    """Poll GET /health until it answers 200; raise if `proc` (a Popen) exits or time runs out."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was healthy")
        try:
            r = await client.get(f"{base_url}/health", timeout=5.0)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/health did not answer within {timeout:.0f} s")
        await asyncio.sleep(0.5)
