"""`radixserve serve --workers N`: N worker processes and the router in front, as one command."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from radixserve.worker_options import WorkerOptions

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on `host`."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_argv(opts: WorkerOptions, port: int) -> list[str]:
    """The command line of one worker: its options, its own port, 1 thread unless set.

    The workers log at the user's level, but at warning when it is left at info (spares the
    terminal the workers' access log of every probe). The API key travels by environment
    (`worker_env`), not on the command line where `ps` would show it.
    """
    opts = opts.replace(
        num_threads=opts.num_threads or 1,
        log_level="warning" if opts.log_level == "info" else opts.log_level,
    )
    head = [sys.executable, "-m", "radixserve.server", "--host", "127.0.0.1", "--port", str(port)]
    return head + opts.to_argv()


def worker_env(opts: WorkerOptions) -> dict[str, str]:
    """The environment of a worker process: ours, with the API key the workers require."""
    env = dict(os.environ)
    env.pop("RADIXSERVE_API_KEY", None)
    if opts.api_key:
        env["RADIXSERVE_API_KEY"] = opts.api_key
    return env


def _die_with_parent() -> None:  # runs in the child before exec (Linux): no orphaned workers
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_workers(opts: WorkerOptions, n: int) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Spawn `n` workers on free loopback ports; returns the processes and their URLs."""
    procs, urls = [], []
    for _ in range(n):
        port = free_port()
        argv = worker_argv(opts, port)
        log.info("starting worker: %s", " ".join(argv))
        procs.append(subprocess.Popen(argv, env=worker_env(opts), preexec_fn=_die_with_parent))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def wait_healthy(
    procs: list[subprocess.Popen[bytes]],
    urls: list[str],
    timeout: float,
    headers: dict[str, str] | None = None,
) -> None:
    """Block until every worker answers /health 200; raise if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    pending = set(range(len(urls)))
    while pending:
        for i in sorted(pending):
            if procs[i].poll() is not None:
                raise RuntimeError(f"worker {urls[i]} exited with code {procs[i].returncode}")
            try:
                if httpx.get(urls[i] + "/health", timeout=2.0, headers=headers).status_code == 200:
                    pending.discard(i)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(
                f"workers not healthy after {timeout:.0f}s: "
                f"{', '.join(urls[i] for i in sorted(pending))}"
            )
        if pending:
            time.sleep(0.5)


def stop_workers(procs: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    """SIGTERM every worker, then SIGKILL what is still running after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def route_args(args: argparse.Namespace, urls: list[str]) -> argparse.Namespace:
    """The router's arguments: route defaults, overridden by same-named serve arguments."""
    from radixserve.router.main import add_route_args

    parser = argparse.ArgumentParser(add_help=False)
    add_route_args(parser)
    out = parser.parse_args([])
    for name in vars(out):
        if name != "worker" and hasattr(args, name):
            setattr(out, name, getattr(args, name))
    out.worker = urls
    if not isinstance(out.log_level, str):
        out.log_level = "info"
    return out


def serve_workers(args: argparse.Namespace) -> int:
    """Run `args.workers` workers plus the router on args.host:args.port; stop them together."""
    from radixserve.router.main import run_route

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.getsignal(signal.SIGINT)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        opts = WorkerOptions.from_namespace(args)
        procs, urls = start_workers(opts, int(args.workers))
        key = opts.api_key
        wait_healthy(
            procs,
            urls,
            timeout=float(getattr(args, "startup_timeout", None) or 900),
            headers={"authorization": f"Bearer {key}"} if key else None,
        )
        log.info("%d workers ready: %s", len(urls), ", ".join(urls))
        # uvicorn handles SIGTERM/SIGINT while it serves and re-raises the signal once it has
        # shut down; no-op handlers make that re-raise harmless, so we get to stop the workers.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        return run_route(route_args(args, urls))
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        stop_workers(procs)
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
