"""The Serve application builder and its config file (no Ray cluster needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
import yaml  # noqa: E402  (comes with ray[serve])

from radixserve.ray.deployments import (  # noqa: E402
    ENGINE_DEPLOYMENT,
    RayDeployment,
    app_builder,
    build_app,
)
from radixserve.server.config import WorkerOptions  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "docs" / "ray_config.yaml"


def engine_deployment(app: object) -> object:
    return app._bound_deployment.init_args[0]._bound_deployment  # type: ignore[attr-defined]


def test_the_documented_config_file_builds_the_app() -> None:
    cfg = yaml.safe_load(CONFIG.read_text())
    (entry,) = cfg["applications"]
    assert entry["import_path"] == "radixserve.ray.deployments:app_builder"
    engine = engine_deployment(app_builder(entry["args"]))
    assert engine.name == ENGINE_DEPLOYMENT
    assert engine.num_replicas == 2
    assert engine.ray_actor_options["num_cpus"] == 2


def test_the_radix_router_is_the_engine_deployments_request_router() -> None:
    engine = engine_deployment(build_app(WorkerOptions(), RayDeployment(num_replicas=3)))
    cls = engine._deployment_config.request_router_config.request_router_class
    assert "RadixRequestRouter" in str(cls)


def test_replicas_get_as_many_torch_threads_as_cpus_they_reserve() -> None:
    app = build_app(WorkerOptions(), RayDeployment(num_cpus=3))
    options = engine_deployment(app).init_args[0]
    assert WorkerOptions.from_dict(options).num_threads == 3


def test_unknown_worker_options_and_routers_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown worker option"):
        app_builder({"worker": {"kv_cache": "1GiB"}})
    with pytest.raises(ValueError, match="unknown router"):
        build_app(WorkerOptions(), RayDeployment(router="nope"))
