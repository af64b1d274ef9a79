"""`ServedEngine`: both engines the server runs over have every member it uses, and the Ray
ingress's `RemoteEngine` answers plainly for what only its replicas can do."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mypy import api as mypy_api
from starlette.testclient import TestClient
from typing_extensions import get_protocol_members

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.ray.bridge import RemoteBridge, RemoteEngine
from radixserve.server.app import build_app
from radixserve.server.engine_api import ServedEngine

REPO = Path(__file__).resolve().parents[2]
INFO = {"model_name": "tiny", "max_model_len": 512, "block_size": 4, "num_blocks": 256}
# Typed assignments for mypy: the package's own mypy run leaves radixserve/ray out.
CONFORMANCE = """
from radixserve.engine.engine import LLMEngine
from radixserve.ray.bridge import RemoteEngine
from radixserve.server.engine_api import ServedEngine


def local(engine: LLMEngine) -> ServedEngine:
    return engine


def remote(tokenizer: object) -> ServedEngine:
    return RemoteEngine(tokenizer, {})  # type: ignore[arg-type]
"""


@pytest.fixture(scope="module")
def llm_engine(
    tiny_pair_factory: Callable[..., Any], default_tokenizer: Any
) -> Iterator[LLMEngine]:
    _, model = tiny_pair_factory(
        vocab_size=49152, hidden_size=32, intermediate_size=64, max_position_embeddings=512
    )
    cfg = EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=256)
    engine = LLMEngine.from_parts(cfg, model, default_tokenizer, "tiny")
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture
def remote_engine(default_tokenizer: Any) -> RemoteEngine:
    return RemoteEngine(default_tokenizer, INFO)


def _ingress_client(engine: RemoteEngine) -> TestClient:
    """The Ray ingress's app, as `OpenAIIngress` builds it (no replicas behind it)."""
    app = build_app(
        engine, bridge_factory=lambda m: RemoteBridge(engine, None, m), cache_events=False
    )
    return TestClient(app, raise_server_exceptions=False)


def test_llm_engine_has_every_member_of_the_protocol(llm_engine: LLMEngine) -> None:
    missing = [m for m in get_protocol_members(ServedEngine) if not hasattr(llm_engine, m)]
    assert not missing
    assert llm_engine.can_reset_prefix_cache and llm_engine.grammars is not None


def test_remote_engine_has_every_member_of_the_protocol(remote_engine: RemoteEngine) -> None:
    missing = [m for m in get_protocol_members(ServedEngine) if not hasattr(remote_engine, m)]
    assert not missing


def test_remote_engine_leaves_grammars_and_resets_to_the_replicas(
    remote_engine: RemoteEngine,
) -> None:
    assert remote_engine.grammars is None
    assert remote_engine.can_reset_prefix_cache is False
    with pytest.raises(NotImplementedError, match="reset_prefix_cache"):
        remote_engine.reset_prefix_cache()


@pytest.mark.parametrize(
    "call",
    [
        lambda e: e.cache_tree(),
        lambda e: e.cache_snapshot(),
        lambda e: e.add_cache_listener(print),
        lambda e: e.remove_cache_listener(print),
        lambda e: e.add_request([1], None),
        lambda e: e.abort("r"),
    ],
    ids=["cache_tree", "cache_snapshot", "add_listener", "remove_listener", "add", "abort"],
)
def test_remote_engine_refuses_what_only_a_replica_can_do(
    remote_engine: RemoteEngine, call: Callable[[RemoteEngine], object]
) -> None:
    with pytest.raises(NotImplementedError, match="the Ray ingress holds no engine"):
        call(remote_engine)


def test_the_local_app_resets_the_prefix_cache(llm_engine: LLMEngine) -> None:
    with TestClient(build_app(llm_engine)) as client:
        r = client.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_the_ray_ingress_has_no_reset_route(remote_engine: RemoteEngine) -> None:
    with _ingress_client(remote_engine) as client:
        r = client.post("/reset_prefix_cache")
        paths = [getattr(route, "path", None) for route in client.app.routes]  # type: ignore[attr-defined]
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    assert "/reset_prefix_cache" not in paths and "/v1/cache/events" not in paths


def test_the_ray_ingress_answers_from_the_replicas_stats(remote_engine: RemoteEngine) -> None:
    with _ingress_client(remote_engine) as client:
        health = client.get("/health")
        stats = client.get("/v1/cache/stats").json()
    assert health.status_code == 200
    assert stats["block_size"] == 4 and stats["num_replicas"] == 0


def test_both_engines_type_check_as_served_engines(tmp_path: Path) -> None:
    snippet = tmp_path / "conformance.py"
    snippet.write_text(CONFORMANCE)
    # radixserve/ray is named explicitly: the mypy config skips following imports into it.
    out, err, status = mypy_api.run(
        ["--config-file", str(REPO / "pyproject.toml"), str(REPO / "radixserve/ray/bridge.py"),
         str(snippet)]
    )  # fmt: skip
    assert status == 0, out + err
