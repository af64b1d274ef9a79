"""Two `radixserve serve` started at once on a fresh cache both come up; the GGUF converts once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radixserve import __version__
from radixserve.router.launcher import free_port

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "64MiB"]


def wait_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    deadline = time.monotonic() + 900
    pending = set(urls)
    while pending and time.monotonic() < deadline:
        for url, proc, log in zip(urls, procs, logs, strict=True):
            if proc.poll() is not None:
                pytest.fail(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if url in pending and httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    pending.discard(url)
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    assert not pending, f"not healthy: {pending}"


def test_two_servers_on_a_fresh_cache_convert_the_model_once(tmp_path: Path) -> None:
    env = {**os.environ, "RADIXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"serve-{p}.log" for p in ports]
    procs = []
    for port, log in zip(ports, logs, strict=True):
        with open(log, "wb") as out:
            argv = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), *ARGS]
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env))
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        wait_healthy(urls, procs, logs)
        for url in urls:
            assert httpx.get(f"{url}/version").json() == {"version": __version__}
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)
    text = [log.read_text() for log in logs]
    assert sum(t.count("(once)") for t in text) == 1, text
    assert sum("waiting for another process converting" in t for t in text) == 1, text
    assert "Traceback" not in "".join(text)
    entries = sorted(p.name for p in (tmp_path / "cache" / "models").iterdir())
    assert [e for e in entries if not e.endswith(".lock")] == [entries[0]]  # one dir, no temp
    assert [e for e in entries if e.endswith(".lock")] == [entries[0] + ".lock"]
