"""How `serve --workers N` turns its own flags into worker and router arguments."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from radixserve.launch import add_serve_args
from radixserve.router.launcher import (
    WorkerSupervisor,
    route_args,
    stop_workers,
    worker_argv,
    worker_env,
)
from radixserve.server.config import WorkerOptions
from radixserve.server.kv_events.config import KVEventsConfig
from tests.support import wait_for


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def opts(*argv: str) -> WorkerOptions:
    return WorkerOptions.from_namespace(serve_args(*argv))


def test_each_worker_publishes_kv_events_on_ports_moved_up_by_its_index() -> None:
    config = '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://127.0.0.1:6000"}'
    o = opts("--workers", "2", "--kv-events-config", config)
    given = []
    for i in range(2):
        tail = worker_argv(o, 8123 + i, i)
        given.append(
            KVEventsConfig.from_dict(json.loads(tail[tail.index("--kv-events-config") + 1]))
        )
    assert [(g.endpoint, g.replay_endpoint) for g in given] == [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:6000"),
        ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:6001"),
    ]


def test_worker_gets_user_flags_its_port_and_one_thread() -> None:
    o = opts(
        "--workers",
        "2",
        "--port",
        "9000",
        "--kv-cache-memory",
        "64MiB",
        "--no-prefix-cache",
        "--dtype",
        "float32",
    )
    argv = worker_argv(o, 8123)
    tail = argv[argv.index("serve") + 1 :]
    assert tail[:4] == ["--host", "127.0.0.1", "--port", "8123"]
    assert "--workers" not in tail and "9000" not in tail
    assert tail[tail.index("--kv-cache-memory") + 1] == "64MiB"
    assert tail[tail.index("--dtype") + 1] == "float32"
    assert "--no-prefix-cache" in tail
    assert tail[-4:] == ["--num-threads", "1", "--log-level", "warning"]


def test_worker_log_level_is_the_users_unless_default() -> None:
    argv = worker_argv(opts("--workers", "2", "--log-level", "debug"), 8123)
    assert argv[-2:] == ["--log-level", "debug"]


def test_worker_keeps_the_users_thread_count() -> None:
    argv = worker_argv(opts("--workers", "2", "--num-threads", "3"), 8123)
    assert argv[argv.index("--num-threads") + 1] == "3"


def test_worker_omits_flags_left_at_their_defaults() -> None:
    argv = worker_argv(opts("--workers", "2"), 8123)
    assert argv[argv.index("serve") + 1 :] == [
        "--host", "127.0.0.1", "--port", "8123", "--num-threads", "1", "--log-level", "warning",
    ]  # fmt: skip


def test_router_takes_the_serve_address_model_and_key() -> None:
    args = serve_args(
        "--workers",
        "2",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--api-key",
        "k",
        "--block-size",
        "32",
    )
    r = route_args(args, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert (r.host, r.port, r.api_key, r.block_size) == ("0.0.0.0", 9000, "k", 32)
    assert r.worker == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert r.policy == "cache_aware"


def test_worker_gets_the_api_key_by_environment_not_argv() -> None:
    o = opts("--workers", "2", "--api-key", "sekret")
    assert "sekret" not in " ".join(worker_argv(o, 8123))
    assert worker_env(o)["RADIXSERVE_API_KEY"] == "sekret"


def test_options_round_trip_through_argv_and_dict() -> None:
    o = opts("--kv-cache-memory", "64MiB", "--no-prefix-cache", "--max-num-seqs", "4")
    assert o.engine_config().enable_prefix_cache is False
    assert o.engine_config().max_num_seqs == 4
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    again = WorkerOptions.from_namespace(parser.parse_args(o.to_argv()))
    assert again == o
    assert WorkerOptions.from_dict(o.to_dict()) == o


def _sleeper() -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(60)"]


def test_supervisor_restarts_a_killed_worker_with_its_own_command_line() -> None:
    procs = [subprocess.Popen(_sleeper()) for _ in range(2)]
    sup = WorkerSupervisor(
        opts("--workers", "2"), procs, ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    )
    assert "--port" in sup.argvs[1] and sup.argvs[1][sup.argvs[1].index("--port") + 1] == "2"
    sup.argvs = [_sleeper(), _sleeper()]
    first = procs[0]
    sup.interval = 0.05
    sup.start()
    try:
        first.kill()
        wait_for(lambda: sup.restarts[0] > 0, 10, "the restart of worker 0")
        assert sup.restarts == [1, 0]
        assert procs[0] is not first and procs[0].poll() is None
    finally:
        sup.stop()
        stop_workers(procs, grace=1)


def test_supervisor_backs_off_a_worker_that_keeps_dying() -> None:
    dies = [sys.executable, "-c", "raise SystemExit(3)"]
    procs = [subprocess.Popen(dies)]
    sup = WorkerSupervisor(opts("--workers", "2"), procs, ["http://127.0.0.1:1"], interval=0.05)
    sup.argvs = [dies]
    started = time.monotonic()
    sup.start()
    try:
        wait_for(lambda: sup.restarts[0] >= 1, 30, "the first restart")
        assert time.monotonic() - started >= 1.0  # it waited the first delay, 1 s
        # The restarted worker dies at once; the next delay is 2 s, so no restart comes in
        # the next 1.5 s (a tight loop would restart it dozens of times).
        time.sleep(1.5)
        assert sup.restarts[0] == 1
    finally:
        sup.stop()
        stop_workers(procs, grace=1)


def test_a_pd_fleets_router_gets_its_prefill_and_decode_workers() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    out = route_args(serve_args("--pd", "1:2", "--port", "9000"), urls, prefill=1)
    assert out.pd_disaggregation and out.prefill == urls[:1] and out.decode == urls[1:]
    assert out.worker == [] and out.port == 9000
    assert route_args(serve_args("--workers", "3"), urls).worker == urls


def test_a_pd_fleets_workers_are_told_their_mode() -> None:
    o = opts("--pd", "1:1")
    sup = WorkerSupervisor(
        [o.replace(disaggregation_mode=m) for m in ("prefill", "decode")],
        [],
        ["http://127.0.0.1:1", "http://127.0.0.1:2"],
    )
    modes = [argv[argv.index("--disaggregation-mode") + 1] for argv in sup.argvs]
    assert modes == ["prefill", "decode"]
