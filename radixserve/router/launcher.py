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
import threading
import time
from typing import Any

import httpx

from radixserve.server.config import WorkerOptions
from radixserve.server.kv_events.config import DEFAULT_ENDPOINT

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now on `host`."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_argv(opts: WorkerOptions, port: int, index: int = 0) -> list[str]:
    """The command line of worker `index`: its options, its own port, 1 thread unless set,
    and its KV event endpoints' ports moved up by `index` (vLLM's convention for ranks).

    The workers log at the user's level, but at warning when it is left at info (spares the
    terminal the workers' access log of every probe). The API key travels by environment
    (`worker_env`), not on the command line where `ps` would show it.
    """
    opts = opts.replace(
        num_threads=opts.num_threads or 1,
        log_level="warning" if opts.log_level == "info" else opts.log_level,
        kv_events_config=offset_kv_events(opts.kv_events_config, index),
    )
    head = [sys.executable, "-m", "radixserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return head + opts.to_argv()


def offset_kv_events(values: dict[str, Any] | None, index: int) -> dict[str, Any] | None:
    """`--kv-events-config` of worker `index`: tcp ports of its endpoints plus `index`."""
    if not values or index == 0:
        return values
    out = dict(values)
    for key in ("endpoint", "replay_endpoint"):
        address = out.get(key, DEFAULT_ENDPOINT if key == "endpoint" else None)
        if isinstance(address, str) and address.startswith("tcp://"):
            head, _, port = address.rpartition(":")
            if port.isdigit() and int(port) != 0:
                out[key] = f"{head}:{int(port) + index}"
    return out


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


def start_workers(
    options: list[WorkerOptions],
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Spawn a worker of each options on free loopback ports; returns the processes and their
    URLs."""
    procs, urls = [], []
    for i, opts in enumerate(options):
        port = free_port()
        argv = worker_argv(opts, port, i)
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


class WorkerSupervisor:
    """Restarts a worker whose process exited, on the same port and command line.

    A background thread polls the processes; `procs` is updated in place, so whoever stops
    the workers later stops the live ones. A worker that keeps dying soon after its start is
    restarted after a doubling delay (1 s up to 30 s) instead of in a tight loop. The router
    takes the restarted worker back once its /health answers 200.
    """

    def __init__(
        self,
        opts: WorkerOptions | list[WorkerOptions],
        procs: list[subprocess.Popen[bytes]],
        urls: list[str],
        interval: float = 0.5,
    ) -> None:
        """`opts`: every worker's options, or each worker's (a PD fleet's prefill and decode
        workers differ in --disaggregation-mode)."""
        options = opts if isinstance(opts, list) else [opts] * len(urls)
        self.procs = procs
        self.argvs = [
            worker_argv(o, int(url.rsplit(":", 1)[1]), i)
            for i, (o, url) in enumerate(zip(options, urls, strict=True))
        ]
        self.env = worker_env(options[0])
        self.urls = urls
        self.interval = interval
        self.restarts = [0] * len(procs)
        self._started = [time.monotonic()] * len(procs)
        self._delay = [0.0] * len(procs)
        self._due: list[float | None] = [None] * len(procs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-supervisor", daemon=True)

    def start(self) -> WorkerSupervisor:
        """Begin watching (returns self)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching; no restart happens after this returns."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for i in range(len(self.procs)):
                self._check(i)

    def _check(self, i: int) -> None:
        now = time.monotonic()
        if self._due[i] is None:
            code = self.procs[i].poll()
            if code is None:
                return
            quick = now - self._started[i] < 30.0
            self._delay[i] = min(30.0, max(1.0, self._delay[i] * 2)) if quick else 0.0
            self._due[i] = now + self._delay[i]
            log.warning(
                "worker %s exited with code %s; restarting it in %.0f s",
                self.urls[i],
                code,
                self._delay[i],
            )
        if now < (self._due[i] or 0.0):
            return
        self._due[i] = None
        self._started[i] = now
        self.procs[i] = subprocess.Popen(self.argvs[i], env=self.env, preexec_fn=_die_with_parent)
        self.restarts[i] += 1


def route_args(args: argparse.Namespace, urls: list[str], prefill: int = 0) -> argparse.Namespace:
    """The router's arguments: route defaults, overridden by same-named serve arguments; the
    first `prefill` of `urls` are a PD fleet's prefill workers, the rest its decode ones."""
    from radixserve.router.main import add_route_args

    parser = argparse.ArgumentParser(add_help=False)
    add_route_args(parser)
    out = parser.parse_args([])
    for name in vars(out):
        if name not in ("worker", "prefill", "decode") and hasattr(args, name):
            setattr(out, name, getattr(args, name))
    if prefill:
        out.pd_disaggregation, out.prefill, out.decode = True, urls[:prefill], urls[prefill:]
    else:
        out.worker = urls
    if not isinstance(out.log_level, str):
        out.log_level = "info"
    return out


def serve_workers(args: argparse.Namespace) -> int:
    """Run `args.workers` workers (or `args.pd`'s prefill and decode workers) plus the router
    on args.host:args.port; stop them together."""
    from radixserve.router.main import run_route

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.getsignal(signal.SIGINT)
    procs: list[subprocess.Popen[bytes]] = []
    supervisor: WorkerSupervisor | None = None
    try:
        opts = WorkerOptions.from_namespace(args)
        n_prefill, n_decode = getattr(args, "pd", None) or (0, 0)
        if n_prefill:
            options = [opts.replace(disaggregation_mode="prefill")] * n_prefill
            options += [opts.replace(disaggregation_mode="decode")] * n_decode
        else:
            options = [opts] * int(args.workers)
        procs, urls = start_workers(options)
        key = opts.api_key
        wait_healthy(
            procs,
            urls,
            timeout=float(getattr(args, "startup_timeout", None) or 900),
            headers={"authorization": f"Bearer {key}"} if key else None,
        )
        log.info("%d workers ready: %s", len(urls), ", ".join(urls))
        supervisor = WorkerSupervisor(options, procs, urls).start()
        # uvicorn handles SIGTERM/SIGINT while it serves and re-raises the signal once it has
        # shut down; no-op handlers make that re-raise harmless, so we get to stop the workers.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        return run_route(route_args(args, urls, n_prefill))
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        if supervisor is not None:
            supervisor.stop()
        stop_workers(procs)
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
