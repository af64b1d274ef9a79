"""Servers the bench starts itself: a subprocess on a free loopback port, healthy or gone."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from radixserve.bench.client import make_client, wait_healthy


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def radixserve_command(*args: str) -> list[str]:
    """`radixserve serve ARGS...` run with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "radixserve.cli", "serve", *args]


class ServerProcess:
    """A server subprocess. `command` may hold `{port}`; without it `--port P` is appended.
    Leading `NAME=VALUE` words of `command` (as a shell reads them) and `env` are added to
    this server's environment only. Its output goes to a log file (kept, and shown in
    errors)."""

    def __init__(
        self,
        command: str | list[str],
        log_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        self.env = dict(env or {})
        while argv and "=" in argv[0] and not argv[0].startswith("-"):
            key, _, value = argv.pop(0).partition("=")
            self.env[key] = value
        if any("{port}" in a for a in argv):
            argv = [a.replace("{port}", str(self.port)) for a in argv]
        else:
            argv += ["--port", str(self.port)]
        self.argv = argv
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="radixserve-bench-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> ServerProcess:
        """Start the process and wait until GET /health answers 200."""
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()

        async def wait() -> None:
            async with make_client() as client:
                await wait_healthy(client, self.url, timeout, self.proc)

        try:
            asyncio.run(wait())
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"{e}\n--- {self.log_path} (tail) ---\n{self.log_tail()}") from e
        return self

    def memory(self) -> tuple[int, int]:
        """(peak, current) resident bytes of the server's process group (VmHWM, VmRSS from
        /proc, summed over its processes); (0, 0) where /proc cannot tell."""
        if self.proc is None:
            return 0, 0
        peak = now = 0
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(
                    line.split(":", 1) for line in status.read_text().splitlines() if ":" in line
                )
                if os.getpgid(int(status.parent.name)) != self.proc.pid:
                    continue
                peak += int(fields.get("VmHWM", "0 kB").split()[0]) * 1024
                now += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
            except (OSError, ValueError):
                continue
        return peak, now

    def log_tail(self, n: int = 30) -> str:
        """The last `n` lines the server wrote."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (then SIGKILL) this server's process group; idempotent."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
