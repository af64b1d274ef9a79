"""radixserve as a subprocess: a server on a free port that a test waits for and stops, and a
one-shot command whose result a test checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.polling import free_port, wait_for

# A real model's server starts in seconds when the machine is idle; a fresh model cache
# converts the GGUF first, and a loaded 2-core machine is several times slower.
STARTUP_TIMEOUT_S = 240.0


def _healthy(response: httpx.Response) -> bool:
    return response.status_code == 200


class ServerProcess:
    """`python -m radixserve.cli <command> --port P <args>` on a free port of 127.0.0.1.

    `url` is its base URL and `log()` what it printed so far (stdout and stderr, in a file:
    `log_path` if given, else a temporary file that `close()` removes).
    """

    def __init__(
        self,
        *args: str,
        command: str = "serve",
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._own_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="radixserve-test-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        argv = [sys.executable, "-m", "radixserve.cli", command, "--port", str(self.port), *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def log(self, tail: int | None = None) -> str:
        """Everything the process printed so far (its last `tail` characters if given)."""
        text = self.log_path.read_text(errors="replace")
        return text[-tail:] if tail else text

    def is_ready(self, ready: Callable[[httpx.Response], bool] = _healthy) -> bool:
        """Whether /health answers and `ready(response)` holds; fails the test (with the log)
        if the process has exited."""
        if self.proc.poll() is not None:
            pytest.fail(f"{self.url} exited with {self.proc.returncode}:\n{self.log(4000)}")
        try:
            return ready(httpx.get(f"{self.url}/health", timeout=2))
        except httpx.HTTPError:
            return False

    def wait_ready(
        self,
        timeout: float = STARTUP_TIMEOUT_S,
        ready: Callable[[httpx.Response], bool] = _healthy,
    ) -> None:
        """Poll /health until `ready(response)` (default: a 200); fail the test with the log
        if the process exits or `timeout` seconds pass (killing it then)."""
        try:
            wait_for(lambda: self.is_ready(ready), timeout, f"{self.url} to be ready", every=0.25)
        except AssertionError:
            self.kill()
            pytest.fail(f"{self.url} not ready after {timeout:.0f} s:\n{self.log(4000)}")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the exit; the exit status (killing it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.proc.returncode)

    def kill(self) -> None:
        """SIGKILL the process if it still runs, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and remove a temporary log."""
        self.terminate()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)


@contextmanager
def running_server(*args: str, **kw: Any) -> Iterator[ServerProcess]:
    """A ready `radixserve serve <args>` (see ServerProcess for `kw`), closed on exit."""
    server = ServerProcess(*args, **kw)
    try:
        server.wait_ready()
        yield server
    finally:
        server.close()


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300.0
) -> subprocess.CompletedProcess[str]:
    """Run `python -m radixserve.cli <args>` in a session of its own; its exit status and
    output, after checking that no process of that session outlived it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with pytest.raises(ProcessLookupError):  # no process of its group is left
        os.killpg(proc.pid, 0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
