"""A local Ray instance serving radixserve's Ray app over a tiny random model (module scope)."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "ray-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve_on_a_free_port(serve: Any, attempts: int = 3) -> int:
    """Start Serve's HTTP proxy on a port free now; the port it listens on.

    A port found free can be taken before the proxy binds it (Ray's own agents open ports
    while starting: CI once lost 52365 that way), so a failed bind is retried on another.
    """
    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as e:
            if "Failed to bind" not in str(e) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def tiny_model_dir(out: Path, default_dir: Path, build_tiny_pair: Callable[..., Any]) -> Path:
    """A 2-layer random Llama saved as a model directory, with the default model's tokenizer."""
    hf, _ = build_tiny_pair(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_dir / name).is_file():
            shutil.copy(default_dir / name, out / name)
    return out


@dataclass
class RayApp:
    url: str
    handle: Any  # to the engine deployment
    event_log: Any


@pytest.fixture(scope="module")
def ray_app(
    tmp_path_factory: pytest.TempPathFactory,
    default_model_files: Any,
    tiny_pair_factory: Callable[..., Any],
) -> Iterator[RayApp]:
    """Two engine replicas behind the ingress on a free port; Ray is stopped afterwards."""
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

    model = tiny_model_dir(
        tmp_path_factory.mktemp("tiny-llama"), Path(default_model_files.path), tiny_pair_factory
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
            max_model_len=512,
            api_key=API_KEY,
            log_level="warning",
        )
        layout = RayDeployment(num_replicas=2, num_cpus=0.5)
        serve.run(build_app(opts, layout), name=APP_NAME, route_prefix="/")
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
        yield RayApp(f"http://127.0.0.1:{port}", handle, get_event_log(APP_NAME, ENGINE_DEPLOYMENT))
    finally:
        serve.shutdown()
        ray.shutdown()
        # Handles left for garbage collection would otherwise start a fresh local Ray
        # instance at exit (Ray connects automatically on first use).
        import ray._private.auto_init_hook as auto_init

        auto_init.enable_auto_connect = False
        time.sleep(1)
