"""Two `radixserve serve` started at once on a fresh cache both come up; the GGUF's model
directory is written once."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from radixserve import __version__
from tests.support import ServerProcess

pytestmark = pytest.mark.slow

ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "64MiB")


def test_two_servers_on_a_fresh_cache_write_the_model_directory_once(tmp_path: Path) -> None:
    env = {"RADIXSERVE_CACHE_DIR": str(tmp_path / "cache")}
    servers = [
        ServerProcess(*ARGS, env=env, log_path=tmp_path / f"serve-{i}.log") for i in range(2)
    ]
    try:
        for server in servers:  # the second waits for the first one to write it
            server.wait_ready(timeout=900)
            assert httpx.get(f"{server.url}/version").json() == {"version": __version__}
    finally:
        exits = [server.terminate() for server in servers]
    assert exits == [0, 0]  # each stopped cleanly on SIGTERM
    text = [server.log() for server in servers]
    assert sum(t.count("(once)") for t in text) == 1, text
    assert sum("waiting for another process reading" in t for t in text) == 1, text
    assert "Traceback" not in "".join(text)
    entries = sorted(p.name for p in (tmp_path / "cache" / "models").iterdir())
    assert [e for e in entries if not e.endswith(".lock")] == [entries[0]]  # one dir, no temp
    assert [e for e in entries if e.endswith(".lock")] == [entries[0] + ".lock"]
