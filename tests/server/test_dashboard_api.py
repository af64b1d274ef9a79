"""The dashboard's routes on a real app over a tiny random engine (in-process, a few seconds)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.server.app import build_app

SYSTEM = "You are the radixserve dashboard test. Keep every answer short and plain."


@pytest.fixture(scope="module")
def tiny_engine_factory(
    tiny_pair_factory: Callable[..., Any], default_tokenizer: Any
) -> Callable[..., LLMEngine]:
    _, model = tiny_pair_factory(
        vocab_size=49152, hidden_size=32, intermediate_size=64, max_position_embeddings=512
    )

    def make(**kw: Any) -> LLMEngine:
        cfg = EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=256, **kw)
        return LLMEngine.from_parts(cfg, model, default_tokenizer, "tiny")

    return make


@contextmanager
def _client(
    make: Callable[..., LLMEngine], engine_kw: dict[str, Any] | None = None, **app_kw: Any
) -> Iterator[TestClient]:
    engine = make(**(engine_kw or {}))
    engine.start()
    try:
        with TestClient(build_app(engine, **app_kw)) as client:
            yield client
    finally:
        engine.shutdown()


def _chat(client: TestClient, question: str, headers: dict[str, str] | None = None) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"messages": messages, "max_tokens": 2, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text


def test_page_and_its_files_are_served_without_a_key(tiny_engine_factory: Any) -> None:
    with _client(tiny_engine_factory, api_key="k") as c:
        page = c.get("/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "/dashboard/static/dashboard.js" in page.text
        for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "css")):
            r = c.get(f"/dashboard/static/{name}")
            assert r.status_code == 200 and kind in r.headers["content-type"]
        assert c.get("/dashboard/static/../app.py").status_code == 404
        assert c.get("/dashboard/static/nope.js").status_code == 404
        config = c.get("/dashboard/config.json").json()
        assert config["auth"] is True and config["panels"] == [{"name": "tiny", "base": "/v1"}]


def test_tree_shows_the_shared_system_prompt_with_its_hits(tiny_engine_factory: Any) -> None:
    with _client(tiny_engine_factory) as c:
        for q in ("one?", "two?", "three?"):
            _chat(c, q)
        body = c.get("/v1/cache/tree").json()
        assert body["enabled"] and body["text"] and body["num_nodes"] >= 3
        real = [n for n in body["nodes"] if n["parent"] is not None]
        widest = max(real, key=lambda n: n["subtree_tokens"])
        assert SYSTEM[:30] in widest["text"]
        assert widest["hits"] == 2 and widest["age_s"] is not None
        with_ids = c.get("/v1/cache/tree?token_ids=true").json()["nodes"][1]
        assert c.app.state.engine.tokenizer.decode_batch([with_ids["token_ids"]]) == [
            with_ids["text"]
        ]
        assert body["top_prefixes"][0]["hits"] == 2


def test_with_the_cache_off_the_tree_says_so(tiny_engine_factory: Any) -> None:
    with _client(tiny_engine_factory, {"enable_prefix_cache": False}) as c:
        _chat(c, "one?")
        body = c.get("/v1/cache/tree").json()
        assert body["enabled"] is False and body["nodes"] == []
        assert c.get("/v1/dashboard/stats").json()["prefix_cache_hits"] == 0


def test_max_nodes_is_validated(tiny_engine_factory: Any) -> None:
    with _client(tiny_engine_factory) as c:
        for bad in ("0", "-3", "abc", "10000000"):
            r = c.get(f"/v1/cache/tree?max_nodes={bad}")
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "max_nodes"
        assert c.get("/v1/cache/tree?max_nodes=1").status_code == 200


def test_with_an_api_key_the_tree_needs_it_and_hides_text(tiny_engine_factory: Any) -> None:
    auth = {"Authorization": "Bearer k"}
    with _client(tiny_engine_factory, api_key="k") as c:
        _chat(c, "one?", auth)
        assert c.get("/v1/cache/tree").status_code == 401
        assert c.get("/v1/dashboard/stats").status_code == 401
        body = c.get("/v1/cache/tree", headers=auth).json()
        assert body["text"] is False and body["num_nodes"] >= 1
        assert not any("text" in n for n in body["nodes"])


def test_show_text_flag_shows_text_despite_the_key(tiny_engine_factory: Any) -> None:
    auth = {"Authorization": "Bearer k"}
    with _client(tiny_engine_factory, api_key="k", dashboard_show_text=True) as c:
        _chat(c, "one?", auth)
        body = c.get("/v1/cache/tree", headers=auth).json()
        assert body["text"] is True
        assert any(SYSTEM[:20] in n.get("text", "") for n in body["nodes"])


def test_stats_counters_move_with_traffic(tiny_engine_factory: Any) -> None:
    with _client(tiny_engine_factory) as c:
        before = c.get("/v1/dashboard/stats").json()
        _chat(c, "one?")
        _chat(c, "two?")
        after = c.get("/v1/dashboard/stats").json()
        assert after["requests"] == before["requests"] + 2
        assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
        assert after["ttft"]["count"] == before["ttft"]["count"] + 2
        assert after["ttft"]["buckets"][-1] == [None, after["ttft"]["count"]]
        b = after["blocks"]
        assert b["free"] + b["cached"] <= b["total"] == 256


def test_grafana_dashboard_queries_only_metrics_the_server_exports(
    tiny_engine_factory: Any,
) -> None:
    dashboard = json.loads((Path(__file__).parents[2] / "docs/grafana/radixserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"radixserve_\w+", e)}
    with _client(tiny_engine_factory) as c:
        _chat(c, "one?")
        exported = set(re.findall(r"^(radixserve_\w+)", c.get("/metrics").text, re.M))
    assert used and used <= exported, used - exported
    assert any("histogram_quantile(0.99" in e for e in exprs)
