"""Faults on one real server (tiny random model): SIGTERM mid-burst, the engine thread
raising mid-step, and a KV pool oversubscribed 8x. Nothing may hang, leak or answer 5xx
except the crash case, which must fail loudly and exit non-zero."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import wait_for

pytestmark = pytest.mark.slow


def complete(url: str, max_tokens: int, prompt: str = "Once upon a time") -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def in_flight(url: str) -> int:
    """Requests waiting + running, from /metrics."""
    total = 0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(("radixserve_num_requests_waiting", "radixserve_num_requests_running")):
            total += int(float(line.split()[-1]))
    return total


def test_sigterm_mid_burst_finishes_in_flight_refuses_new_and_exits_zero(
    launch: Any, tiny_model_dir: Path
) -> None:
    with launch("--model", str(tiny_model_dir), "--shutdown-timeout", "120") as server:
        with ThreadPoolExecutor(8) as pool:
            burst = [pool.submit(complete, server.url, 900) for _ in range(8)]
            wait_for(lambda: in_flight(server.url) == 8, 60, "8 requests in flight")
            server.proc.send_signal(signal.SIGTERM)
            late = complete(server.url, 5)
            results = [f.result() for f in burst]
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "shutting_down"
        assert late.headers["retry-after"]
        for r in results:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 900
        assert server.proc.wait(60) == 0


def test_engine_failure_mid_step_errors_requests_turns_health_503_and_exits_nonzero(
    launch: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_FAULT_INJECT", "step:3")
    with launch("--model", str(tiny_model_dir)) as server:
        r = complete(server.url, 20)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        refused = complete(server.url, 5)
        assert refused.status_code == 503
        assert server.proc.wait(30) == 1
        assert "injected failure in engine step 3" in server.log()


def test_pool_oversubscribed_8x_ends_every_request_within_bounded_time(
    launch: Any, tiny_model_dir: Path, block_size: int
) -> None:
    # The tiny model's KV costs 256 bytes a token: 64 KiB is a pool of 256 tokens (16 blocks).
    # 16 requests of ~100 prompt + 28 new tokens ask for 2048 tokens at once: 8x the pool.
    # --max-model-len 256: one request must fit the pool (a start-up check refuses less).
    argv = ["--model", str(tiny_model_dir), "--kv-cache-memory", "64KiB", "--max-model-len", "256"]
    with launch(*argv) as server:
        stats = httpx.get(f"{server.url}/v1/cache/stats", timeout=10).json()
        pool_tokens = stats["total_blocks"] * block_size
        prompts = [f"request {i}: " + "tell me a story about caching " * 16 for i in range(16)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as ex:
            results = list(ex.map(lambda p: complete(server.url, 28, p), prompts))
        wall = time.monotonic() - t0
        demand = sum(r.json()["usage"]["total_tokens"] for r in results if r.status_code == 200)
        statuses = sorted({r.status_code for r in results})
        assert all(
            r.status_code == 200 or 400 <= r.status_code < 500 or r.status_code == 503
            for r in results
        ), statuses
        assert wall < 240, f"took {wall:.0f} s"
        assert demand >= 6 * pool_tokens, (demand, pool_tokens)  # the pool really was short
        counts = {s: sum(r.status_code == s for r in results) for s in statuses}
        print(
            f"\n8x pool: {len(results)} requests, statuses {counts}, {wall:.1f} s wall, "
            f"{demand} tokens asked of a {pool_tokens}-token pool"
        )
        idle = httpx.get(f"{server.url}/v1/cache/stats", timeout=10).json()
        assert idle["locked_blocks"] == 0 and idle["private_blocks"] == 0
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
