"""SIGTERM: refuse new requests, let in-flight requests finish, end event streams, exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow


def stops_accepting(url: str, within: float) -> bool:
    """True once connecting to `url` is refused, polling for at most `within` seconds. A
    connection the kernel had queued when the server closed its socket is reset instead of
    refused (ECONNRESET before any response): that is a refusal too."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            return True
        time.sleep(0.05)
    return False


def test_sigterm_finishes_in_flight_requests_and_exits_zero(launch: Any) -> None:
    with launch("--shutdown-timeout", "60") as server:
        events_ended = threading.Event()

        def follow_cache_events() -> None:
            with httpx.stream("GET", f"{server.url}/v1/cache/events", timeout=120) as r:
                for _ in r.iter_lines():
                    pass
            events_ended.set()

        threading.Thread(target=follow_cache_events, daemon=True).start()
        body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            assert stops_accepting(server.url, within=60.0)  # once the stream has drained
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        # The endless event stream was closed instead of holding the shutdown for 60 s.
        assert server.proc.wait(30) == 0
        assert events_ended.wait(5)
