"""radixserve on a local Ray Serve instance: the OpenAI API, exact mirrors, a killed replica."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import free_port, wait_for, write_tiny_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "ray-test-key"


@dataclass
class RayApp:
    """The running app: the ingress' URL, a handle to the engine deployment, the event log."""

    url: str
    handle: Any
    event_log: Any


def start_serve_on_a_free_port(serve: Any, attempts: int = 3) -> int:
    """Start Serve's HTTP proxy on a port free now; the port it listens on.

    A port found free can be taken before the proxy binds it (Ray's own agents open ports
    while starting: CI once lost 52365 that way), and on a busy machine the proxy actor may
    not start within Serve's fixed 60 s: both are retried, on another port.
    """
    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            again = any(s in why for s in ("Failed to bind", "ProxyActor", "GetTimeoutError"))
            if not again or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory: pytest.TempPathFactory, default_model_files: Any) -> Iterator[RayApp]:
    """Two engine replicas of a tiny random model behind the ingress on a free port; Ray is
    stopped afterwards."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from radixserve.ray.deployments import (
        APP_NAME,
        ENGINE_DEPLOYMENT,
        RayDeployment,
        build_app,
    )
    from radixserve.ray.events import get_event_log
    from radixserve.server.config import WorkerOptions

    model = write_tiny_model(
        tmp_path_factory.mktemp("tiny-llama"),
        default_model_files.path,
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    # Few logical CPUs: this machine has 2 cores; the workers import this checkout.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        log_to_driver=False,
    )
    try:
        port = start_serve_on_a_free_port(serve)
        opts = WorkerOptions(
            model=str(model),
            dtype="float32",
            kv_cache_memory="512KiB",  # 128 blocks of 16 tokens: evictions come quickly
            max_model_len=1024,  # the pool holds two requests of it at once
            api_key=API_KEY,
            log_level="warning",
        )
        layout = RayDeployment(num_replicas=2, num_cpus=0.5)
        serve.run(build_app(opts, layout), name=APP_NAME, route_prefix="/")
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
        yield RayApp(f"http://127.0.0.1:{port}", handle, get_event_log(APP_NAME, ENGINE_DEPLOYMENT))
    finally:
        import ray._private.auto_init_hook as auto_init

        from radixserve.ray.events import stop_following

        # This driver's handle runs a router on Serve's loop thread (once a test has used
        # it): its pulls must end before Ray does, or one would start a fresh local Ray
        # instance from that thread (Ray connects automatically on first use) whose shutdown
        # at exit ends pytest with status 1. Handles left for garbage collection would do the
        # same.
        stop_following()
        auto_init.enable_auto_connect = False
        serve.shutdown()
        ray.shutdown()


def client(app: RayApp, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key=key, max_retries=0, timeout=120)


def conversation_turns(c: openai.OpenAI, topic: str, turns: int) -> list[int]:
    """Run a chat of `turns` turns; the cached prompt tokens of each turn."""
    messages: list[Any] = [{"role": "system", "content": "You are a terse assistant."}]
    cached = []
    for t in range(turns):
        # Long enough turns that the history is most of each prompt (the policy routes by
        # cache only when the match saves a good share of the prefill).
        ask = f"Tell me fact {t} about {topic}. " + " ".join(f"{topic}{t}x{j}" for j in range(20))
        messages.append({"role": "user", "content": ask})
        r = c.chat.completions.create(
            model=None,
            messages=messages,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return cached


def replica_caches(app: RayApp) -> dict[str, list[Any]]:
    """Each engine replica's own cached paths (asked until both have answered)."""
    out: dict[str, list[Any]] = {}

    def both_answered() -> bool:
        snap = app.handle.cache_snapshot.remote().result()
        out[snap["replica"]] = sorted(snap["paths"], key=repr)
        return len(out) == 2

    # A handle learns of a new replica within seconds; callers check how many answered.
    with contextlib.suppress(AssertionError):
        wait_for(both_answered, 60, "both replicas' cache snapshots")
    return out


def log_mirrors(app: RayApp) -> dict[str, list[Any]]:
    import ray

    _, updates = ray.get(app.event_log.pull.remote(None, {}, 0))
    return {r: sorted(u.snapshot, key=repr) for r, u in updates.items()}


def mirrors_equal_caches(app: RayApp, replicas: int = 2) -> bool:
    """Whether the event log's mirror of each of `replicas` replicas equals its cache."""
    caches = replica_caches(app)
    mirrors = log_mirrors(app)
    return len(caches) == replicas and all(mirrors.get(r) == p for r, p in caches.items())


def ingress_counter(app: RayApp, name: str) -> float:
    """The value of the unlabelled counter `name` (without _total) on the ingress' /metrics."""
    text = httpx.get(f"{app.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    found = re.search(rf"^{name}_total (\S+)$", text, re.M)
    assert found is not None, text[-2000:]
    return float(found.group(1))


def replica_stats(app: RayApp) -> dict[str, dict[str, Any]]:
    """The engine stats each replica last pushed to the event log (about once a second)."""
    import ray

    stats: dict[str, dict[str, Any]] = ray.get(app.event_log.replica_stats.remote())
    return stats


def test_later_turns_of_a_chat_hit_the_cache_of_one_replica(ray_app: RayApp) -> None:
    cached = conversation_turns(client(ray_app), "otters", 4)
    # With a random router the four turns would share a replica one time in eight.
    assert all(n > 0 for n in cached[1:]), cached
    assert cached[1] < cached[2] < cached[3]


def test_streaming_usage_errors_and_auth_match_the_server(ray_app: RayApp) -> None:
    c = client(ray_app)
    stream = c.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens_details is not None
    with pytest.raises(openai.AuthenticationError):
        client(ray_app, "wrong").models.list()
    r = httpx.post(
        f"{ray_app.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 10_000},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert c.models.list().data[0].id


def test_the_event_log_mirrors_each_replica_exactly_through_evictions(ray_app: RayApp) -> None:
    c = client(ray_app)
    for i in range(30):  # ~10 blocks each, 128 blocks per replica: both evict
        c.completions.create(
            model=None,  # type: ignore[arg-type]
            prompt=f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(60)),
            max_tokens=2,
            temperature=0,
        )

    def evicted() -> int:  # from the stats each replica pushes every second
        stats = httpx.get(
            f"{ray_app.url}/v1/cache/stats", headers={"Authorization": f"Bearer {API_KEY}"}
        ).json()
        return sum(r["evicted_blocks_total"] for r in stats["replicas"].values())

    wait_for(evicted, 30, "evictions")
    # Events reach the log a moment after the engine applies them: exact equality once the
    # last ones have arrived.
    wait_for(lambda: mirrors_equal_caches(ray_app), 30, "the log's mirrors equal the caches")


def test_a_killed_replica_loses_no_request_and_a_new_one_is_mirrored(ray_app: RayApp) -> None:
    import ray
    from ray import serve

    before = set(replica_caches(ray_app))
    assert len(before) == 2
    resent = ingress_counter(ray_app, "radixserve_ray_resent_requests")
    c = client(ray_app)

    def ask(i: int, max_tokens: int = 64) -> int:
        """Completion tokens of a non-streamed request (which its replica's death must not lose)."""
        r = c.completions.create(
            model=None,  # type: ignore[arg-type]
            prompt=f"Request {i} about rivers and their deltas",
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].finish_reason == "length"
        return r.usage.completion_tokens

    def in_flight() -> dict[str, int]:
        """Requests running or waiting on each replica, as of its last stats (~1 s old)."""
        stats = replica_stats(ray_app)
        return {r: s["num_running"] + s["num_waiting"] for r, s in stats.items() if r in before}

    # Stats left over from earlier requests must not pass for these ones.
    wait_for(lambda: len(in_flight()) == 2 and not any(in_flight().values()), 30, "idle replicas")
    # Eight requests of 900 tokens: each pool holds two at once, so a replica has requests
    # running and waiting for seconds, far longer than its stats take to show them.
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i, 900) for i in range(8)]
        busy = wait_for(lambda: {r for r, n in in_flight().items() if n}, 120, "busy replicas")
        victim = sorted(busy)[0]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        done = [f.result() for f in futures]
    assert done == [900] * 8  # every request answered in full: none lost
    # What ran on the victim was sent again, to the other replica.
    assert ingress_counter(ray_app, "radixserve_ray_resent_requests") > resent

    def two_running() -> bool:
        status = serve.status().applications["radixserve"].deployments["RadixEngine"]
        return bool(status.replica_states.get("RUNNING", 0) == 2)

    wait_for(two_running, 240, "Serve to replace the killed replica", every=2)
    now = set(replica_caches(ray_app))
    assert len(now) == 2 and victim not in now
    fresh = (now - before).pop()
    numbers = iter(range(100, 100_000))

    def fresh_cached() -> bool:
        """One more request; whether the new replica has cached something. Traffic reaches it
        only once the router has pulled its empty pool from the event log, which may take
        longer than a few short requests right after it started."""
        ask(next(numbers))
        return bool(log_mirrors(ray_app).get(fresh))

    wait_for(fresh_cached, 120, "traffic to reach the new replica", every=0.2)
    wait_for(
        lambda: bool(log_mirrors(ray_app).get(fresh)) and mirrors_equal_caches(ray_app),
        30,
        "the log's mirror of the new replica equal to its cache",
    )
    # The routers tell the log to forget the dead replica.
    wait_for(lambda: victim not in log_mirrors(ray_app), 30, "the log to forget the killed one")
