"""Prefill/decode disaggregation, the server's side (docs/disaggregation.md).

A prefill worker (`serve --disaggregation-mode prefill`) answers POST
/v1/disaggregation/prefill: the prompt's token ids, the request's sampling and the first
token the decode worker lacks K/V from; it runs the request through its own tree to its first
token and answers the K/V of the prompt's whole blocks from there, with that token
(engine/handoff.py's wire format). A decode worker (`--disaggregation-mode decode`) handed a
request whose `kv_transfer_params` name a prefill worker (the PD router sets them) asks it so,
puts the K/V into its own pool and tree, and continues the request from that token. A request
the handoff cannot carry (n or best_of > 1, prompt log-probs, a grammar, returned logits) is
served on the decode worker alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.engine.handoff import KVHandoff, decode, encode, encode_parts, pool_layout
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.params import SamplingParams
from radixserve.server.bridge import RequestStream
from radixserve.server.errors import APIError
from radixserve.server.protocol import read_json_body

if TYPE_CHECKING:
    from radixserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)

MODES = ("null", "prefill", "decode")  # SGLang's --disaggregation-mode
BACKENDS = ("auto", "http", "shm")  # --disaggregation-transfer-backend
PREFILL_PATH = "/v1/disaggregation/prefill"
WRITE_BACK_PATH = "/v1/disaggregation/write_back"
# A decode worker's error code when the prefill worker it was told to use failed (the router
# then asks the next one)
PREFILL_UNAVAILABLE = "prefill_unavailable"
# The shm transport: handoffs as files here, named so; one its reader never took is removed
# after SHM_TTL_S seconds.
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "radixserve-pd-"
SHM_TTL_S = 60.0
# SamplingParams fields a prefill worker does not take: it draws one token of one choice.
_NOT_SENT = ("max_tokens", "n", "best_of", "structured", "return_logits", "prompt_logprobs")
_MAX_PREFILL_BODY = 64 << 20


def can_hand_off(params: SamplingParams) -> bool:
    """Whether a request with `params` can be prefilled elsewhere (one choice, no prompt
    log-probs, grammar or returned logits)."""
    return (
        params.num_samples == 1
        and params.prompt_logprobs is None
        and params.structured is None
        and not params.return_logits
    )


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """`params` as the prefill route's JSON `sampling` (logit_bias keys as strings)."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    for name in _NOT_SENT:
        out.pop(name)
    out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    out["min_tokens"] = min(params.min_tokens, 1)  # of the one token drawn there
    return out


def _first_token_params(sampling: Any) -> SamplingParams:
    if not isinstance(sampling, dict) or any(k in sampling for k in _NOT_SENT):
        raise APIError(400, "sampling: an object of SamplingParams fields", param="sampling")
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(sampling) - fields
    if unknown:
        raise APIError(400, f"sampling: unknown fields {sorted(unknown)}", param="sampling")
    bias = sampling.get("logit_bias") or {}
    try:
        sampling = {**sampling, "logit_bias": {int(k): v for k, v in bias.items()}}
    except (AttributeError, ValueError):
        raise APIError(400, "sampling.logit_bias: token ids as keys", param="sampling") from None
    return SamplingParams(**sampling, max_tokens=1)


class TransferMetrics:
    """What handoffs moved, on the server's Prometheus registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handoffs = Counter(
            "radixserve_kv_transfer_requests",
            "Requests prefilled on another worker, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.bytes = Counter(
            "radixserve_kv_transfer_bytes", "K/V bytes received from prefill workers",
            registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "radixserve_kv_transfer_tokens", "Prompt tokens whose K/V was received",
            registry=registry,
        )  # fmt: skip
        self.seconds = Counter(
            "radixserve_kv_transfer_seconds",
            "Seconds from asking a prefill worker to the K/V in this pool",
            registry=registry,
        )
        self.write_backs = Counter(
            "radixserve_kv_write_back_requests",
            "Finished requests whose K/V past the prompt went back to the prefill worker",
            ["outcome"],
            registry=registry,
        )
        self.written_back = Counter(
            "radixserve_kv_write_back_tokens", "Tokens whose K/V went back to prefill workers",
            registry=registry,
        )  # fmt: skip


class PrefillRole:
    """POST /v1/disaggregation/prefill on a prefill worker. Its shm files are named with its
    pid: it removes those no decode worker took when it stops, and at its start those of
    prefill workers no longer running."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._written: set[Path] = set()
        _sweep_shm()

    async def prefill(self, request: Request) -> Response:
        """Run the request to its first token; answer its handoff (engine/handoff.py's wire
        format: as application/octet-stream, or with "transfer": "shm" in a file under
        SHM_DIR whose path the JSON answer names)."""
        body = await read_json_body(request, _MAX_PREFILL_BODY)
        ids, start = body.get("token_ids"), body.get("start", 0)
        namespace = body.get("namespace")
        if not isinstance(ids, list) or not ids:
            raise APIError(400, "token_ids: a non-empty list of token ids", param="token_ids")
        bs = self.engine.block_size
        if not isinstance(start, int) or start < 0 or start % bs:
            raise APIError(400, f"start: a multiple of the block size ({bs})", param="start")
        if namespace is not None and not isinstance(namespace, str):
            raise APIError(400, "namespace: a string or null", param="namespace")
        transfer = body.get("transfer", "http")
        if transfer not in ("http", "shm"):
            raise APIError(400, "transfer: 'http' or 'shm'", param="transfer")
        params = _first_token_params(body.get("sampling", {}))
        out = await self._run(ids, params, namespace, start)
        if out.finish_reason not in ("stop", "length") or out.kv_handoff is None:
            raise APIError(503, f"the prefill failed: {out.error or out.finish_reason}")
        parts = encode_parts(out.kv_handoff)
        if transfer == "shm" and SHM_DIR.is_dir():
            path = await asyncio.to_thread(_write_shm, parts)
            self._written.add(path)
            asyncio.get_running_loop().call_later(SHM_TTL_S, self._forget, path)
            return JSONResponse({"shm": str(path), "nbytes": sum(p.nbytes for p in parts)})
        data = await asyncio.to_thread(b"".join, parts)
        return Response(data, media_type="application/octet-stream")

    async def write_back(self, request: Request) -> Response:
        """Take a decode worker's K/V of what it computed past a prompt this worker prefilled
        (the wire format, in the body) into this pool and tree."""
        data = await request.body()
        namespace = request.query_params.get("namespace")
        pool = self.engine.kv_pool
        handoff = await asyncio.to_thread(decode, data, pool_layout(pool), pool.k.dtype)
        added = await asyncio.to_thread(self.engine.import_handoff, handoff, namespace)
        return JSONResponse({"tokens": added})

    def _forget(self, path: Path) -> None:
        """Remove `path` if its decode worker never took it."""
        self._written.discard(path)
        _remove(path)

    async def close(self) -> None:
        """Remove the shm files no decode worker took."""
        for path in list(self._written):
            self._forget(path)

    async def _run(
        self, ids: list[int], params: SamplingParams, namespace: str | None, start: int
    ) -> RequestOutput:
        """The request's final output, through the bridge's RequestStream (not observed: no
        client reads these tokens); aborted if the decode worker goes away first."""
        stream = RequestStream(self.engine, asyncio.get_running_loop(), None)
        stream.request_id = self.engine.add_request(
            ids, params, request_id=f"prefill-{uuid.uuid4().hex}", namespace=namespace,
            on_output=stream.on_output, bounded=True, export_kv_from=start,
        )  # fmt: skip
        try:
            return await stream.result()
        finally:
            stream.close()


class DecodeRole:
    """A decode worker's handoffs: ask the prefill worker a request names, take its K/V."""

    def __init__(
        self, engine: LLMEngine, registry: CollectorRegistry, api_key: str | None = None,
        timeout: float = 600.0, backend: str = "auto",
    ) -> None:  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"transfer backend {backend!r}: one of {', '.join(BACKENDS)}")
        self.engine, self.backend = engine, backend
        self._sending: set[asyncio.Task[None]] = set()  # write-backs under way
        self.metrics = TransferMetrics(registry)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None
        self._headers, self._timeout = headers, httpx.Timeout(timeout, connect=5.0)
        pool = engine.kv_pool
        self.layout = pool_layout(pool)
        self.dtype = pool.k.dtype

    def client(self) -> httpx.AsyncClient:
        """The HTTP client to prefill workers (made on the serving event loop)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self._timeout, trust_env=False)
        return self._client

    async def handoff(
        self, prompt_ids: list[int], params: SamplingParams, namespace: str | None,
        transfer: dict[str, Any] | None,
    ) -> dict[str, Any]:  # fmt: skip
        """EngineBridge.submit's arguments for a request prefilled on the worker `transfer`
        names, its K/V now in this pool and tree: the first token that worker drew, and the
        write-back of what this worker computes after the prompt's whole blocks, which that
        worker then holds too (its next turn prefills only what is new). {} where the request
        names no prefill worker or cannot be handed off. A prefill worker that fails is a 503
        (the router tries another pair)."""
        url = (transfer or {}).get("prefill_url")
        if not url:
            return {}
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise APIError(
                400, "kv_transfer_params.prefill_url: an http(s) URL", param="kv_transfer_params"
            )
        if not can_hand_off(params):
            self.metrics.handoffs.labels("served_here").inc()
            return {}
        t0 = time.monotonic()
        start = self.engine.kv.cache.peek_prefix(prompt_ids, namespace)
        start = min(start, (len(prompt_ids) - 1) // self.engine.block_size * self.engine.block_size)
        body = {
            "token_ids": prompt_ids, "namespace": namespace, "start": start,
            "sampling": sampling_fields(params), "transfer": self._transfer(url),
        }  # fmt: skip
        try:
            r = await self.client().post(
                url.rstrip("/") + PREFILL_PATH, json=body, headers=self._headers
            )
        except httpx.HTTPError as e:
            self.metrics.handoffs.labels("prefill_failed").inc()
            raise APIError(
                503, f"the prefill worker {url} failed: {type(e).__name__}: {e}",
                code=PREFILL_UNAVAILABLE,
            ) from None  # fmt: skip
        if r.status_code != 200:
            self.metrics.handoffs.labels("prefill_failed").inc()
            if 400 <= r.status_code < 500:  # the request itself: the client's error, as is
                raise APIError(r.status_code, _message(r))
            raise APIError(
                503, f"the prefill worker {url} answered HTTP {r.status_code}: {_message(r)}",
                code=PREFILL_UNAVAILABLE,
            )  # fmt: skip
        try:
            h = await asyncio.to_thread(self._read, r)
        except Exception as e:
            self.metrics.handoffs.labels("prefill_failed").inc()
            raise APIError(
                503, f"the prefill worker {url} sent no usable K/V: {e}",
                code=PREFILL_UNAVAILABLE,
            ) from None  # fmt: skip
        added = await asyncio.to_thread(self.engine.import_handoff, h, namespace)
        self.metrics.handoffs.labels("handed_off").inc()
        self.metrics.bytes.inc(h.nbytes)
        self.metrics.tokens.inc(added)
        self.metrics.seconds.inc(time.monotonic() - t0)
        back_from = len(prompt_ids) // self.engine.block_size * self.engine.block_size
        return {
            "first_token": h.first, "export_kv_from": back_from,
            "on_finished": lambda out: self._write_back(url, namespace, out),
        }  # fmt: skip

    def _write_back(self, url: str, namespace: str | None, out: RequestOutput) -> None:
        """Send a finished request's K/V past its prompt's whole blocks (its last partial
        block, its answer) to the prefill worker at `url`, in the background; a failure
        costs that worker a prefill later, nothing else."""
        handoff: KVHandoff | None = out.kv_handoff
        if out.finish_reason not in ("stop", "length") or handoff is None or not handoff.num_blocks:
            return

        async def send() -> None:
            data = await asyncio.to_thread(encode, handoff)
            try:
                r = await self.client().post(
                    url.rstrip("/") + WRITE_BACK_PATH, content=data, headers=self._headers,
                    params={} if namespace is None else {"namespace": namespace},
                )  # fmt: skip
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            self.metrics.write_backs.labels("ok" if ok else "failed").inc()
            if ok:
                self.metrics.written_back.inc(handoff.num_blocks * self.engine.block_size)

        task = asyncio.get_running_loop().create_task(send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    def _transfer(self, url: str) -> str:
        """The transport to ask `url` for: shm for "shm", and for "auto" where the prefill
        worker is on this host's loopback; else http."""
        if self.backend != "auto":
            return self.backend
        host = urlsplit(url).hostname or ""
        try:
            local = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = False
        return "shm" if local and SHM_DIR.is_dir() else "http"

    def _read(self, r: httpx.Response) -> KVHandoff:
        """The handoff in a prefill worker's answer: its body, or the shm file it names (read,
        then removed)."""
        if not r.headers.get("content-type", "").startswith("application/json"):
            return decode(r.content, self.layout, self.dtype)
        path = Path(str(r.json().get("shm", "")))
        if path.parent != SHM_DIR or not path.name.startswith(SHM_PREFIX):
            raise ValueError(f"{path} is not a handoff file under {SHM_DIR}")
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        finally:
            _remove(path)
        return decode(data, self.layout, self.dtype)

    async def close(self) -> None:
        """Close the client."""
        if self._client is not None:
            await self._client.aclose()


def _write_shm(parts: list[memoryview]) -> Path:
    """`parts` into a new file under SHM_DIR, named with this process's pid (readable by
    this user only); its path."""
    fd, name = tempfile.mkstemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=SHM_DIR)
    with os.fdopen(fd, "wb") as f:
        for part in parts:
            f.write(part)
    return Path(name)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def _sweep_shm() -> None:
    """Remove the shm files of prefill workers that are no longer running (killed before
    they could)."""
    if not SHM_DIR.is_dir():
        return
    for path in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        pid = path.name.removeprefix(SHM_PREFIX).partition("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _remove(path)
        except PermissionError:  # another user's running process
            pass


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
