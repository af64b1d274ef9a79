"""A real `radixserve serve` subprocess on a free port of 127.0.0.1, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

# Small and fast: float32 on CPU, a short context and a small KV pool.
BASE_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "128MiB"]
BLOCK_SIZE = 16
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server subprocess; `url` is its base URL, `log()` its output so far."""

    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, path = tempfile.mkstemp(prefix="radixserve-test-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        cmd = [sys.executable, "-m", "radixserve", "serve", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*cmd, *BASE_ARGS, "--log-level", "info", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Poll /health until it answers 200; fail with the server's log if it never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        pytest.fail(f"server not ready after {timeout:.0f}s:\n{self.log()[-4000:]}")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the exit; returns the exit code (killing it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.proc.returncode)

    def kill(self) -> None:
        """Kill the process if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def running_server(*args: str) -> Iterator[ServerProcess]:
    """A ready server with extra serve options; stopped (SIGTERM) on exit."""
    server = ServerProcess(list(args))
    try:
        server.wait_ready()
        yield server
    finally:
        server.terminate()
        server.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def launch() -> object:
    """`launch(*serve_options)`: a context manager running a ready server (see running_server)."""
    return running_server


@pytest.fixture(scope="session")
def block_size() -> int:
    """The KV block size the test servers use (the default)."""
    return BLOCK_SIZE


@pytest.fixture(scope="session")
def default_server() -> Iterator[ServerProcess]:
    """A server with the default options, shared by the modules that need nothing else."""
    with running_server() as server:
        yield server
