"""Prefill/decode disaggregation when a part fails: a decode worker killed mid-request, a
transfer cut off or garbled, a prefill worker that is gone. The router retries on another pair
or answers a clear 503, and no request, block or pin is left behind on either worker.
`serve --pd 1:2` on the default model in float32 (one prefill worker, two decode workers)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router.test_cluster import children, port_of
from tests.router.test_pd import ARGS, metric
from tests.support import ServerProcess, wait_for

pytestmark = pytest.mark.slow


class Fleet:
    def __init__(self) -> None:
        self.server = ServerProcess("--pd", "1:2", *ARGS)
        self.url = self.server.url

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/health", timeout=10).json())

    @property
    def prefill(self) -> str:
        return str(self.health()["prefill_workers"][0]["url"])

    def decode(self, i: int) -> dict[str, Any]:
        return dict(self.health()["workers"][i])


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        f.server.wait_ready()
        yield f
    finally:
        f.server.close()


def ask(url: str, i: int, max_tokens: int = 64, **extra: Any) -> httpx.Response:
    body = {
        "prompt": f"Request {i}: a few words about rivers and their deltas.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def settled(url: str) -> bool:
    """Nothing running or waiting, and no block pinned, on the worker at `url`."""
    running = metric(url, "radixserve_num_requests_running")
    waiting = metric(url, "radixserve_num_requests_waiting")
    text = httpx.get(f"{url}/metrics", timeout=10).text
    locked = [ln for ln in text.splitlines() if 'state="locked"' in ln and not ln.startswith("#")]
    return running == 0 and waiting == 0 and all(float(ln.split()[-1]) == 0 for ln in locked)


def test_a_decode_worker_killed_mid_request_loses_no_request(fleet: Fleet) -> None:
    pids = children(fleet.server.pid)
    d0 = fleet.decode(0)
    victim = next(p for p in pids if port_of(p) == int(d0["url"].rsplit(":")[-1]))
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, fleet.url, i, 200) for i in range(6)]
        wait_for(lambda: fleet.decode(0)["in_flight"] > 0, what="requests on decode worker 0")
        os.kill(victim, signal.SIGKILL)
        results = [f.result() for f in futures]
    for r in results:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 200
    retries = metric(fleet.url, "radixserve_router_retries_total")
    assert retries >= 1  # what was in flight on the dead worker was answered by the other
    wait_for(lambda: settled(fleet.prefill), timeout=30, what="the prefill worker idle")
    wait_for(lambda: fleet.decode(0)["healthy"], timeout=240, what="decode worker 0 restarted")


class _FakePrefill(BaseHTTPRequestHandler):
    """A prefill worker whose answer breaks: `cut` sends half its body and hangs up,
    `garbage` sends a whole body that is not a handoff."""

    mode = "cut"

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["content-length"]))
        body = b"RADIXSERVE-PD-1\n" + b"\0" * 4096
        self.send_response(200)
        self.send_header("content-type", "application/octet-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.mode == "cut":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        else:
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (/health says it is fine; nothing else is here)
        healthy = self.path == "/health"
        body = b'{"status": "ok"}' if healthy else b'{"error": {"message": "no"}}'
        self.send_response(200 if healthy else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def fake_prefill(mode: str) -> ThreadingHTTPServer:
    """A _FakePrefill server of `mode` on a free port, serving in a thread."""
    fake = ThreadingHTTPServer(("127.0.0.1", 0), type("Fake", (_FakePrefill,), {"mode": mode}))
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    return fake


@pytest.mark.parametrize("mode", ["cut", "garbage"])
def test_a_broken_transfer_is_a_503_and_leaves_nothing_behind(fleet: Fleet, mode: str) -> None:
    fake = fake_prefill(mode)
    try:
        url = f"http://127.0.0.1:{fake.server_address[1]}"
        d = fleet.decode(1)["url"]
        r = ask(d, 1, 4, kv_transfer_params={"prefill_url": url})
        assert r.status_code == 503, r.text
        assert "prefill worker" in r.json()["error"]["message"]
        assert settled(d)
        assert ask(d, 2, 4).status_code == 200  # and it keeps serving
    finally:
        fake.shutdown()


@contextlib.contextmanager
def pd_router(prefill: list[str], decode: str, ready: bool = True) -> Iterator[ServerProcess]:
    """`route --pd-disaggregation` over `prefill` and `decode` (healthy first if `ready`)."""
    urls = [a for url in prefill for a in ("--prefill", url)]
    router = ServerProcess(
        "--pd-disaggregation", *urls, "--decode", decode, "--log-level", "warning",
        command="route",
    )  # fmt: skip
    try:
        if ready:
            router.wait_ready()
        yield router
    finally:
        router.close()


def all_answered(router: ServerProcess, first: int, n: int = 4) -> None:
    for i in range(first, first + n):
        r = ask(router.url, i, 4)
        assert r.status_code == 200, r.text


def test_a_prefill_worker_that_is_gone_is_passed_over_and_none_left_is_a_503(
    fleet: Fleet,
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    d = fleet.decode(1)["url"]
    with pd_router([dead, fleet.prefill], d) as router:
        all_answered(router, 10)
    with pd_router([dead], d, ready=False) as router:
        wait_for(lambda: router.is_ready(lambda r: r.status_code == 503), 30, "a 503 /health")
        r = ask(router.url, 20, 4)
        assert r.status_code == 503, r.text
        assert "prefill worker" in r.json()["error"]["message"]
    assert settled(d)


def test_a_prefill_worker_that_breaks_while_healthy_is_passed_over_on_the_same_decode_worker(
    fleet: Fleet,
) -> None:
    """Its /health says ok but its transfers break: the decode worker's 503 sends the router
    to the next prefill worker, with the same decode worker (the only one here)."""
    fake = fake_prefill("cut")
    broken = f"http://127.0.0.1:{fake.server_address[1]}"
    d = fleet.decode(1)["url"]
    try:
        with pd_router([broken, fleet.prefill], d) as router:
            all_answered(router, 30)
    finally:
        fake.shutdown()
    assert settled(d) and settled(fleet.prefill)


def test_clients_that_leave_mid_stream_leave_nothing_behind(fleet: Fleet) -> None:
    """8 streams at once through the router; half the clients hang up after a few chunks.
    Every request the others read ends in full, and then no request runs or waits and no
    block is pinned on any worker."""

    def stream(i: int, leave: bool) -> int:
        body = {
            "prompt": f"Stream {i}: a long story about rivers, deltas and the sea.",
            "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True,
        }  # fmt: skip
        chunks = 0
        with httpx.stream("POST", f"{fleet.url}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if leave and chunks == 3:
                        return chunks
        return chunks

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: stream(i, i % 2 == 1), range(8)))
    assert all(n >= 100 for n in got[0::2]) and all(n == 3 for n in got[1::2])
    urls = [fleet.prefill, fleet.decode(0)["url"], fleet.decode(1)["url"]]
    wait_for(lambda: all(settled(u) for u in urls), timeout=60, what="every worker idle")


def test_a_stopping_prefill_worker_removes_the_files_no_decode_worker_took(fleet: Fleet) -> None:
    """Asked for a handoff through /dev/shm by a decode worker that then never read it (as
    one killed in between): the file stays until the prefill worker stops. (Last: it stops
    the fleet.)"""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    body = {"token_ids": list(range(100, 140)), "sampling": {"temperature": 0}, "transfer": "shm"}
    r = httpx.post(f"{fleet.prefill}/v1/disaggregation/prefill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    path = Path(r.json()["shm"])
    assert path.exists() and path.parent == Path("/dev/shm")
    assert fleet.server.terminate() == 0  # the launcher stops its workers
    wait_for(lambda: not path.exists(), timeout=30, what="the handoff file removed")
