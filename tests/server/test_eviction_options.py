"""Eviction options through the HTTP app: API-key tiers, session ids, metrics and stats.

An in-process app over a tiny random engine (no subprocess): fast, and what it checks is
what reaches the cache, not what the model says.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixserve.cache.node import RadixNode
from radixserve.cache.trie import post_order
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.server.app import build_app
from radixserve.server.config import WorkerOptions
from radixserve.server.main import add_serve_args
from radixserve.server.tiers import load_api_key_tiers

TIERS = {"gold-key": 2, "free-key": 0}


@pytest.fixture
def app_client(tiny_pair_factory: Any, default_tokenizer: Any) -> Iterator[tuple[TestClient, Any]]:
    _, model = tiny_pair_factory(
        vocab_size=49152, hidden_size=32, intermediate_size=64, max_position_embeddings=512
    )
    cfg = EngineConfig(block_size=4, num_blocks=64, eviction_policy="priority", session_ttl=60.0)
    engine = LLMEngine.from_parts(cfg, model, default_tokenizer, "tiny")
    engine.start()
    try:
        with TestClient(build_app(engine, api_key_tiers=TIERS)) as client:
            yield client, engine
    finally:
        engine.shutdown()


def cached_nodes(engine: LLMEngine) -> list[RadixNode]:
    root = engine.kv.cache._roots[None]
    return [n for n in post_order(root) if n is not root]


def complete(client: TestClient, key: str, prompt: list[int], **extra: Any) -> Any:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra.pop("body", {})}
    headers = {"authorization": f"Bearer {key}", **extra.pop("headers", {})}
    return client.post("/v1/completions", json=body, headers=headers)


def test_tier_keys_are_accepted_and_others_rejected(app_client: Any) -> None:
    client, _ = app_client
    assert complete(client, "free-key", list(range(10, 30))).status_code == 200
    assert complete(client, "nope", list(range(10, 30))).status_code == 401


def test_a_keys_tier_becomes_the_cached_paths_priority(app_client: Any) -> None:
    client, engine = app_client
    r = complete(client, "gold-key", list(range(100, 120)), body={"priority": 0})
    assert r.status_code == 200
    assert [n.priority for n in cached_nodes(engine)] == [2]


def test_session_header_or_user_keeps_the_path_warm(app_client: Any) -> None:
    client, engine = app_client
    complete(client, "free-key", list(range(200, 220)))
    assert all(n.warm_until == 0.0 for n in cached_nodes(engine))
    complete(client, "free-key", list(range(300, 320)), headers={"x-session-id": "agent-7"})
    complete(client, "free-key", list(range(400, 420)), body={"user": "u1"})
    warm = sorted(n.token_ids[0] for n in cached_nodes(engine) if n.warm_until > 0)
    assert warm == [300, 400]


def refetch_counts(client: TestClient) -> tuple[int, float]:
    """(refetch_blocks of /v1/cache/stats, radixserve_cache_refetch_blocks_total of /metrics)."""
    stats = client.get("/v1/cache/stats", headers={"authorization": "Bearer free-key"}).json()
    metric = re.search(
        r"^radixserve_cache_refetch_blocks_total (\S+)$", client.get("/metrics").text, re.M
    )
    assert metric is not None
    return stats["refetch_blocks"], float(metric.group(1))


def test_stats_and_metrics_report_policy_and_refetches(app_client: Any) -> None:
    client, engine = app_client
    stats = client.get("/v1/cache/stats", headers={"authorization": "Bearer free-key"}).json()
    assert stats["eviction_policy"] == "priority"
    assert refetch_counts(client) == (0, 0.0)
    first = list(range(1000, 1040))  # 10 blocks of 4 tokens
    assert complete(client, "free-key", first).status_code == 200
    # 8 other prompts of 10 blocks each through a 64-block pool: the first one is evicted.
    for k in range(8):
        other = list(range(2000 + 100 * k, 2040 + 100 * k))
        assert complete(client, "free-key", other).status_code == 200
    assert engine.stats().evicted_blocks_total > 0
    assert refetch_counts(client) == (0, 0.0)  # evictions alone are not refetches
    again = complete(client, "free-key", first)  # prefilled again soon after its eviction
    assert again.status_code == 200
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < len(first) - 4
    blocks, metric = refetch_counts(client)
    assert 0 < blocks <= len(first) // 4 and metric == blocks


def test_serve_flags_reach_the_engine_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(
        ["--eviction-policy", "fanout", "--session-ttl", "30", "--namespace-quota", "0.5"]
    )

    def engine_config(ns: argparse.Namespace) -> EngineConfig:
        return WorkerOptions.from_namespace(ns).engine_config()

    cfg = engine_config(args)
    assert (cfg.eviction_policy, cfg.session_ttl, cfg.namespace_quota) == ("fanout", 30.0, 0.5)
    assert engine_config(parser.parse_args([])).eviction_policy == EngineConfig().eviction_policy
    for bad in (["--eviction-policy", "mru"], ["--namespace-quota", "1.5"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_tiers_file_must_map_keys_to_integers(tmp_path: Any) -> None:
    good = tmp_path / "tiers.json"
    good.write_text('{"k1": 1, "k2": 0}')
    assert load_api_key_tiers(good) == {"k1": 1, "k2": 0}
    for text in ('["k1"]', '{"k1": "gold"}', "{", "{}"):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError):
            load_api_key_tiers(tmp_path / "bad.json")
