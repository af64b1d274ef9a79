"""`/dashboard` on the router: one panel per worker, each worker's tree forwarded."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.bench.dashboard import headless_chromium, missing
from tests.support import wait_for

from .fakes import FakeCluster


def test_config_lists_one_panel_per_worker_and_the_page_is_served() -> None:
    c = FakeCluster(n=2)
    try:
        config = c.http.get("/dashboard/config.json").json()
        assert [p["base"] for p in config["panels"]] == [
            "/v1/router/workers/0",
            "/v1/router/workers/1",
        ]
        assert config["auth"] is False
        assert "dashboard.js" in c.http.get("/dashboard").text
        assert c.http.get("/dashboard/static/dashboard.js").status_code == 200
    finally:
        c.close()


def test_each_panel_gets_its_own_workers_tree_and_stats() -> None:
    c = FakeCluster(n=2)
    try:
        r = c.chat("a prompt long enough to fill several blocks of the fake tokenizer")
        index = int(r.headers["x-radixserve-worker"])
        trees = [c.http.get(f"/v1/router/workers/{i}/cache/tree").json() for i in (0, 1)]
        assert [t["worker"] for t in trees] == ["w0", "w1"]
        assert trees[index]["num_nodes"] == 1 and trees[1 - index]["num_nodes"] == 0
        stats = c.http.get(f"/v1/router/workers/{index}/dashboard/stats?x=1").json()
        assert stats["worker"] == f"w{index}" and stats["blocks"]["cached"] > 0
        assert c.http.get("/v1/router/workers/2/cache/tree").status_code == 404
        assert c.http.get("/v1/router/workers/0/cache/events").status_code == 404
    finally:
        c.close()


def test_worker_data_needs_the_router_key_and_is_forwarded_with_the_worker_key() -> None:
    c = FakeCluster(n=1, route_flags=("--api-key", "sekrit"), api_key="sekrit")
    try:
        assert c.http.get("/v1/router/workers/0/cache/tree").status_code == 401
        assert c.http.get("/dashboard/config.json").json()["auth"] is True
        r = c.http.get(
            "/v1/router/workers/0/cache/tree", headers={"authorization": "Bearer sekrit"}
        )
        assert r.status_code == 200 and r.json()["text"] is False
    finally:
        c.close()


@pytest.mark.slow
def test_page_draws_one_live_panel_per_worker_in_a_browser() -> None:
    why = missing()
    if why:
        pytest.skip(why)
    c = FakeCluster(n=2, route_flags=("--policy", "round_robin"))  # both workers get traffic
    try:
        shared = "a long shared instruction for every request: " * 3
        for k in range(6):
            c.chat(shared + f"question {k}")
        with headless_chromium() as browser:
            browser.get(c.router.url + "/dashboard")

            def widest_nodes() -> list[Any]:
                nodes: list[Any] = browser.execute_script(
                    "const p = radixDashboard.state.panels;"
                    "return p.length ? p.map((_, k) => radixDashboard.widestNode(k)) : []"
                )
                return nodes if len(nodes) == 2 and all(nodes) else []

            widest = wait_for(widest_nodes, 30, "both panels' widest nodes", every=0.5)
            names = browser.execute_script(
                "return [...document.querySelectorAll('.panel-name')].map(e => e.textContent)"
            )
            status = browser.execute_script("return document.getElementById('status').className")
        assert [n.split(" · ")[0] for n in names] == ["worker 0", "worker 1"]
        assert len(widest) == 2 and all(widest), widest
        assert "error" not in status
        # The fake workers' trees carry no text (as a keyed server's would not).
        assert all(w["text"] is None and w["tokens"] > 0 for w in widest)
    finally:
        c.close()
