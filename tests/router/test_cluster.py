"""`radixserve serve --workers 2`: real worker processes and the router, driven with `openai`.

One cluster for the module (two model loads); tests run in file order and share it.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import ServerProcess, wait_for

pytestmark = pytest.mark.slow

# Small and fast: float32, one thread per worker, a short context, a KV pool of ~40 blocks
# so that a handful of conversations already forces evictions (the pool still has to hold one
# request of --max-model-len: 39 blocks x 16 = 624 tokens).
WORKER_ARGS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "28MiB")
STARTUP_TIMEOUT_S = 240.0


def children(pid: int) -> list[int]:
    """Direct child pids of `pid`, spawned by any of its threads (Linux: the launcher's
    supervisor thread starts restarted workers)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def port_of(pid: int) -> int:
    """The --port of a worker process, from its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(argv[argv.index(b"--port") + 1])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return " Z " not in stat  # a zombie has exited


class Cluster:
    """The launcher process (a ServerProcess) and the clients the tests talk to it with."""

    def __init__(self) -> None:
        self.server = ServerProcess("--workers", "2", *WORKER_ARGS, "--log-level", "warning")
        self.proc = self.server.proc
        self.url = self.server.url
        self.model = ""
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )

    def log(self) -> str:
        return self.server.log(5000)

    def wait_ready(self) -> None:
        """Until the router and both workers are healthy; then learn the model's name."""

        def all_workers_up(r: httpx.Response) -> bool:
            return r.status_code == 200 and all(w["healthy"] for w in r.json()["workers"])

        self.server.wait_ready(ready=all_workers_up)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def workers(self) -> list[dict[str, Any]]:
        return list(self.http.get("/health").json()["workers"])

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 4) -> tuple[int, Any]:
        """(worker index, ChatCompletion) of one non-streamed chat request."""
        raw = self.client.chat.completions.with_raw_response.create(
            model=self.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
        )
        return int(raw.headers["x-radixserve-worker"]), raw.parse()

    def close(self) -> None:
        self.http.close()
        self.server.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        c.wait_ready()
        yield c
    finally:
        c.close()


def conversation(topic: str) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": f"Let us talk about {topic}. " * 6
            + f"What is the single most surprising fact about {topic}?",
        }
    ]


def test_turns_stay_on_one_worker_and_conversations_spread(cluster: Cluster) -> None:
    topics = ["volcanoes", "penguins", "medieval castles", "jazz music"]
    convs = [conversation(t) for t in topics]
    where: list[set[int]] = [set() for _ in convs]
    for turn in range(3):
        for i, msgs in enumerate(convs):
            w, answer = cluster.chat(msgs)
            where[i].add(w)
            if turn:
                assert answer.usage.prompt_tokens_details.cached_tokens > 0
            msgs += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": f"Tell me more, part {turn}."},
            ]
    assert all(len(s) == 1 for s in where), where
    assert set.union(*where) == {0, 1}


def test_stream_passes_through_with_usage(cluster: Cluster) -> None:
    stream = cluster.client.chat.completions.create(
        model=cluster.model,
        messages=conversation("rivers"),
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_completions_with_a_shared_prefix_land_together(cluster: Cluster) -> None:
    prompt = "Once upon a time, in a land of tall mountains and deep valleys, " * 6
    first = cluster.client.completions.with_raw_response.create(
        model=cluster.model, prompt=prompt + "there lived", max_tokens=2, temperature=0
    )
    second = cluster.client.completions.with_raw_response.create(
        model=cluster.model, prompt=prompt + "a dragon", max_tokens=2, temperature=0
    )
    assert first.headers["x-radixserve-worker"] == second.headers["x-radixserve-worker"]
    usage = second.parse().usage
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens // 2


def snapshot(url: str) -> list[tuple[Any, tuple[int, ...]]]:
    """The worker's cache contents: the first event of its /v1/cache/events stream."""
    with httpx.stream("GET", url + "/v1/cache/events", timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                assert event["type"] == "snapshot"
                return sorted(
                    ((p["namespace"], tuple(p["token_ids"])) for p in event["paths"]), key=repr
                )
    raise AssertionError("no snapshot")


def router_tree(cluster: Cluster, index: int) -> list[tuple[Any, tuple[int, ...]]]:
    w = cluster.http.get("/v1/router/tree").json()["workers"][index]
    return sorted(((p["namespace"], tuple(p["token_ids"])) for p in w["paths"]), key=repr)


def test_router_tries_equal_worker_caches_after_evictions(cluster: Cluster) -> None:
    for i in range(10):  # ~10 x 9 blocks into two pools of ~40 blocks: evictions on both
        cluster.chat(conversation(f"subject number {i}"), max_tokens=2)
    evicted = 0
    for w in cluster.workers():
        stats = httpx.get(w["url"] + "/v1/cache/stats").json()
        evicted += stats.get("evicted_blocks", 0)
    assert evicted > 0
    for i, w in enumerate(cluster.workers()):
        assert w["cache_events_live"]
        wait_for(
            lambda i=i, w=w: router_tree(cluster, i) == snapshot(w["url"]),
            timeout=15,
            what=f"router's trie of worker {i} equal to its cache",
        )


def test_killed_worker_loses_no_request_and_is_restarted(cluster: Cluster) -> None:
    pids = children(cluster.proc.pid)
    assert len(pids) == 2
    victim = next(p for p in pids if port_of(p) == int(cluster.workers()[0]["url"].rsplit(":")[-1]))
    msgs = [conversation(f"question {i}") for i in range(10)]

    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(cluster.chat, m, 16) for m in msgs]
        wait_for(lambda: cluster.workers()[0]["in_flight"] > 0, what="requests on worker 0")
        os.kill(victim, signal.SIGKILL)
        served = [f.result()[0] for f in futures]  # raises if any request failed
    assert len(served) == 10
    metrics = cluster.http.get("/metrics").text.splitlines()
    retries = next(ln for ln in metrics if ln.startswith("radixserve_router_retries_total "))
    assert float(retries.split()[1]) >= 1  # what was in flight there was answered elsewhere
    print(f"\nkill -9 under load: {len(served)}/10 served, router retries {retries.split()[1]}")
    # The launcher restarts it by itself, on the same port.
    port = int(cluster.workers()[0]["url"].rsplit(":")[-1])

    def restarted() -> list[int]:
        return [p for p in children(cluster.proc.pid) if p not in pids and alive(p)]

    def restarted_ports() -> list[int | None]:
        # Between fork and exec a child's cmdline is still the launcher's (whose --port is the
        # router's, or absent): read it once the worker's own command line is there.
        out: list[int | None] = []
        for p in restarted():
            try:
                argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
                out.append(None if b"--workers" in argv else port_of(p))
            except (OSError, ValueError):
                out.append(None)
        return out

    wait_for(lambda: restarted_ports() == [port], timeout=30, what="worker 0 restarted on its port")
    assert "restarting it" in cluster.log()
    wait_for(
        lambda: cluster.workers()[0]["healthy"], timeout=STARTUP_TIMEOUT_S, what="worker 0 back up"
    )
    assert cluster.chat(conversation("after the restart"))[0] in (0, 1)


def test_launcher_stops_every_worker(cluster: Cluster) -> None:
    pids = children(cluster.proc.pid)
    # Both workers (worker 0 restarted above) are seen alive first: `children` reads /proc
    # and swallows its errors, so an empty list would make "all gone" below prove nothing.
    assert len(pids) == 2 and all(alive(p) for p in pids), pids
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(60) == 0
    wait_for(lambda: not any(alive(p) for p in pids), timeout=30, what="workers gone")
