"""SIGTERM: refuse new requests, let in-flight requests finish, end event streams, exit 0."""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

import httpx
import pytest

from tests.support import wait_for

pytestmark = pytest.mark.slow


def refuses_connections(url: str) -> bool:
    """Whether connecting to `url` is refused now. A connection the kernel had queued when the
    server closed its socket is reset instead of refused (ECONNRESET before any response):
    that is a refusal too."""
    try:
        httpx.get(f"{url}/health", timeout=1)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
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
            # once the stream has drained
            wait_for(lambda: refuses_connections(server.url), 60, "the server to stop listening")
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        # The endless event stream was closed instead of holding the shutdown for 60 s.
        assert server.proc.wait(30) == 0
        assert events_ended.wait(5)
