"""The router's HTTP behaviour against in-process fake workers (no model, a few seconds)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_for

from .fakes import CharTokenizer, FakeCluster


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    c = FakeCluster()
    yield c
    c.close()


def test_non_streamed_answer_and_usage_pass_through(cluster: FakeCluster) -> None:
    r = cluster.chat("hello there")
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r.headers["x-radixserve-worker"] in ("0", "1")


def test_stream_is_passed_through_chunk_by_chunk(cluster: FakeCluster) -> None:
    body = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with cluster.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert "usage" in json.loads(lines[-2][5:])
    assert sum(w.in_flight for w in cluster.balancer.workers) == 0


def test_turns_of_a_conversation_stay_on_one_worker() -> None:
    cluster = FakeCluster(num_blocks=1024)  # room for every conversation: no evictions
    try:
        _converse(cluster)
    finally:
        cluster.close()


def _converse(cluster: FakeCluster) -> None:
    convs = [
        [{"role": "user", "content": f"conversation {c} is about topic {c}. " * 3}]
        for c in range(4)
    ]
    workers: list[set[str]] = [set() for _ in convs]
    for turn in range(4):
        for c, msgs in enumerate(convs):  # interleaved, like concurrent users
            workers[c].add(_turn(cluster, msgs, f"and what about part {turn}?"))
    assert all(len(w) == 1 for w in workers), workers
    assert len(set.union(*workers)) == 2, "unrelated conversations spread over both workers"


def _turn(cluster: FakeCluster, msgs: list[dict[str, str]], next_question: str) -> str:
    """Send the conversation so far; append the answer and `next_question`; return the worker."""
    r = cluster.http.post("/v1/chat/completions", json={"model": "f", "messages": msgs})
    assert r.status_code == 200
    msgs += [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": next_question},
    ]
    return str(r.headers["x-radixserve-worker"])


def test_sequential_conversations_sharing_a_system_prompt_spread_and_stay() -> None:
    # One client at a time: no load to balance, and the system prompt is cached on the
    # first worker before the second conversation starts. It must not pin every
    # conversation there.
    cluster = FakeCluster(num_blocks=1024)
    system = {"role": "system", "content": "You are a helpful assistant. " * 4}
    convs = [[system, {"role": "user", "content": f"question {c} " * 12}] for c in range(4)]
    workers: list[set[str]] = [set() for _ in convs]
    try:
        for c, msgs in enumerate(convs):
            for turn in range(3):
                workers[c].add(_turn(cluster, msgs, f"and part {turn}?"))
                wait_for(lambda: _mirrors_caught_up(cluster), what="mirrors caught up")
    finally:
        cluster.close()
    assert all(len(w) == 1 for w in workers), workers
    assert len(set.union(*workers)) == 2, workers


def _mirrors_caught_up(cluster: FakeCluster) -> bool:
    return all(
        w.trie.num_blocks == a.state.trie.num_blocks
        for w, a in zip(cluster.balancer.workers, cluster.apps, strict=True)
    )


def test_failed_attempt_is_retried_on_the_other_worker(cluster: FakeCluster) -> None:
    cluster.states[0].fail_next = [503]  # idle and empty workers: worker 0 is tried first
    r = cluster.chat("retry me")
    assert r.status_code == 200
    assert r.headers["x-radixserve-worker"] == "1"
    assert cluster.states[0].fail_next == []
    text = cluster.http.get("/metrics").text
    assert "radixserve_router_retries_total 1.0" in text


def test_error_when_every_attempt_fails_is_openai_style(cluster: FakeCluster) -> None:
    for s in cluster.states:
        s.fail_next = [500]
    r = cluster.chat("fail me")
    assert r.status_code == 502
    assert "answered HTTP 500: w" in r.json()["error"]["message"]


def test_worker_busy_status_and_message_are_reported(cluster: FakeCluster) -> None:
    cluster.states[0].fail_next = [503]
    cluster.states[1].fail_next = [503]
    r = cluster.chat("busy")
    assert r.status_code == 503
    assert "answered HTTP 503: w1 says 503" in r.json()["error"]["message"]
    assert r.headers["retry-after"] == "1"


def test_client_errors_are_not_retried(cluster: FakeCluster) -> None:
    for s in cluster.states:
        s.fail_next = [400]
    r = cluster.chat("bad")
    assert r.status_code == 400
    assert sum(len(s.fail_next) for s in cluster.states) == 1


def test_invalid_json_from_worker_is_a_502() -> None:
    c = FakeCluster(bad_json=True)
    try:
        r = c.chat("x")
        assert r.status_code == 502
        assert r.json()["error"]["message"].endswith("invalid JSON")
    finally:
        c.close()


def test_dead_worker_is_taken_out_and_request_retried(cluster: FakeCluster) -> None:
    cluster.workers[0].stop()
    for i in range(4):
        assert cluster.chat(f"still served {i}").status_code == 200
    w0 = cluster.balancer.workers[0]
    wait_for(lambda: not w0.healthy, what="worker 0 down")
    health = cluster.http.get("/health").json()
    assert health["workers"][0]["healthy"] is False
    assert w0.trie.num_blocks == 0
    cluster.workers[0].start()  # same port: it comes back
    wait_for(lambda: w0.healthy, what="worker 0 back up")


def test_no_healthy_worker_is_a_503(cluster: FakeCluster) -> None:
    for w in cluster.workers:
        w.stop()
    wait_for(lambda: not cluster.balancer.healthy(), what="all down")
    r = cluster.chat("anyone?")
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable"
    assert cluster.http.get("/health").status_code == 503


def test_models_answered_by_a_worker(cluster: FakeCluster) -> None:
    assert cluster.http.get("/v1/models").json()["data"][0]["id"] == "fake"


def test_version_is_the_routers_own(cluster: FakeCluster) -> None:
    from radixserve import __version__

    assert cluster.http.get("/version").json() == {"version": __version__}


def evicted_blocks(cluster: FakeCluster) -> list[int]:
    """Blocks each fake worker's own cache has evicted so far."""
    return [app.state.trie.cache.stats().evicted_blocks for app in cluster.apps]


def router_counter(cluster: FakeCluster, name: str) -> dict[str, float]:
    """The router's counter `name` (without _total) by worker label, from its /metrics."""
    text = cluster.http.get("/metrics").text
    return {
        s.labels["worker"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for s in family.samples
        if s.name == name + "_total"
    }


def test_mirror_matches_worker_cache_after_evictions() -> None:
    # Health probes a minute apart: no drift check can resync a mirror during the test, so
    # the mirrors can only match through the insert and evict events.
    cluster = FakeCluster(route_flags=("--health-interval", "60"))
    try:
        for i in range(40):  # 7 shared prefixes and ~8 new blocks a turn into 64-block caches
            r = cluster.chat(f"conversation {i % 7} " * 3 + f"turn {i} " * 4)
            assert r.status_code == 200, r.text
        assert all(n > 0 for n in evicted_blocks(cluster)), evicted_blocks(cluster)
        for w, app in zip(cluster.balancer.workers, cluster.apps, strict=True):
            real = sorted(app.state.trie.paths(), key=repr)
            assert real  # a cache still holding something: empty == empty would prove nothing
            wait_for(
                lambda w=w, real=real: sorted(w.trie.paths(), key=repr) == real,
                what=f"mirror of {w.name} equal to its cache",
            )
        resyncs = router_counter(cluster, "radixserve_router_mirror_resyncs")
        assert set(resyncs.values()) == {0.0}, resyncs
    finally:
        cluster.close()


def test_mirror_resyncs_when_evictions_lack_their_length() -> None:
    c = FakeCluster(send_num_tokens=False, num_blocks=24)
    try:
        for i in range(20):
            r = c.chat(f"topic {i % 5} " * 4 + f"q{i}")
            assert r.status_code == 200, r.text
        # Without num_tokens the mirror drops only each evicted path's last block, so it
        # drifts from a worker that evicted more; the health probes notice and resync it.
        assert sum(evicted_blocks(c)) > 0, evicted_blocks(c)
        for w, app in zip(c.balancer.workers, c.apps, strict=True):
            wait_for(
                lambda w=w, app=app: (
                    sorted(w.trie.paths(), key=repr) == sorted(app.state.trie.paths(), key=repr)
                ),
                timeout=10,
                what=f"mirror of {w.name} resynced",
            )
            assert app.state.trie.paths()
        resyncs = router_counter(c, "radixserve_router_mirror_resyncs")
        assert sum(resyncs.values()) >= 1, resyncs
    finally:
        c.close()


def test_cache_salt_matches_only_within_its_namespace(cluster: FakeCluster) -> None:
    long = "a long shared document " * 4
    first = cluster.chat(long, cache_salt="alice")
    w = cluster.balancer.workers[int(first.headers["x-radixserve-worker"])]
    wait_for(
        lambda: (
            w.trie.match(
                CharTokenizer().apply_chat_template([{"role": "user", "content": long}]), "alice"
            )
            > 0
        ),
        what="insert event",
    )
    ids = CharTokenizer().apply_chat_template([{"role": "user", "content": long}])
    assert w.trie.match(ids, None) == 0
    assert w.trie.match(ids, "bob") == 0


def test_api_key_is_checked_at_the_router_and_forwarded() -> None:
    c = FakeCluster(route_flags=("--api-key", "sekrit"), api_key="sekrit")
    try:
        assert c.chat("no key").status_code == 401
        r = c.http.post(
            "/v1/chat/completions",
            headers={"authorization": "Bearer sekrit"},
            json={"model": "f", "messages": [{"role": "user", "content": "k"}]},
        )
        assert r.status_code == 200
        assert c.http.get("/health").status_code == 200  # health needs no key
    finally:
        c.close()


def test_client_key_is_forwarded_when_router_has_none(cluster: FakeCluster) -> None:
    r = cluster.http.post(
        "/v1/chat/completions",
        headers={"authorization": "Bearer abc"},
        json={"model": "f", "messages": [{"role": "user", "content": "k"}]},
    )
    assert r.status_code == 200
    assert "Bearer abc" in [a for s in cluster.states for a in s.auth_seen]


def test_normalize_whitespace_forwards_the_normalised_body() -> None:
    c = FakeCluster(route_flags=("--normalize-whitespace",))
    try:
        c.chat("  spaced out\r\nline  \n")
        bodies = [b for s in c.states for b in s.bodies]
        assert bodies[-1]["messages"][0]["content"] == "spaced out\nline"
    finally:
        c.close()


def test_metrics_report_workers_and_decisions(cluster: FakeCluster) -> None:
    cluster.chat("count me")
    text = cluster.http.get("/metrics").text
    assert "radixserve_router_decisions_total" in text
    assert 'radixserve_router_worker_up{worker="' in text
    assert "radixserve_router_matched_prefix_tokens_total" in text
    assert "radixserve_router_in_flight" in text


def test_malformed_body_is_a_400(cluster: FakeCluster) -> None:
    r = cluster.http.post("/v1/chat/completions", content=b"[1, 2")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_without_cache_events_routed_prompts_are_recorded() -> None:
    c = FakeCluster(route_flags=("--no-cache-events",))
    try:
        long = "a conversation that is long enough to matter " * 3
        w = int(c.chat(long).headers["x-radixserve-worker"])
        worker = c.balancer.workers[w]
        assert not worker.events_live
        ids = CharTokenizer().apply_chat_template([{"role": "user", "content": long}])
        assert worker.trie.match(ids) == len(ids) // 4 * 4
        msgs = [
            {"role": "user", "content": long},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "go on"},
        ]
        r = c.http.post("/v1/chat/completions", json={"model": "f", "messages": msgs})
        assert int(r.headers["x-radixserve-worker"]) == w
    finally:
        c.close()


def test_malformed_cache_event_makes_the_router_resubscribe() -> None:
    c = FakeCluster(bad_events=1)
    try:
        c.chat("something to cache " * 3)
        for w, app in zip(c.balancer.workers, c.apps, strict=True):
            wait_for(lambda w=w: w.events_live, what=f"{w.name} resubscribed")
            assert sorted(w.trie.paths(), key=repr) == sorted(app.state.trie.paths(), key=repr)
        assert all(s.bad_events == 0 for s in c.states)
    finally:
        c.close()


def test_transport_attribute_error_on_a_killed_worker_is_retried_not_a_500(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # httpcore raised this on a pooled connection to a worker killed with SIGKILL (found by
    # the kill -9 fault test); it must count as a failed connection, not crash the proxy.
    dead = cluster.workers[0].url
    real_post = httpx.AsyncClient.post

    async def post(self: httpx.AsyncClient, url: str, **kw: Any) -> httpx.Response:
        if str(url).startswith(dead):
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        return await real_post(self, url, **kw)

    monkeypatch.setattr(httpx.AsyncClient, "post", post)
    r = cluster.chat("after a kill")
    assert r.status_code == 200 and r.headers["x-radixserve-worker"] == "1"
