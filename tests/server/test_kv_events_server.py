"""A real `radixserve serve --kv-events-config`: the events it publishes, replayed into a
mirror, rebuild its cache tree exactly, through prefill, eviction under a small pool, offload
to the tier and drops from it, a reset, and a warm restart."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from radixserve.router.kv_mirror import BlockMirror
from radixserve.router.trie import WorkerTrie
from radixserve.server.kv_events.replay import request_replay
from radixserve.server.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_batch,
)
from tests.support import free_port, running_server, write_tiny_model

pytestmark = pytest.mark.slow

BS = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (KV: 8 KiB per 16-token block in float32)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def serve_args(model: Path, persist: Path) -> tuple[list[str], str]:
    replay = f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": replay,
        "buffer_steps": 100_000,
    }
    args = [
        "--model", str(model), "--dtype", "float32", "--max-model-len", "256",
        "--kv-cache-memory", "256KiB", "--kv-offload-memory", "128KiB",
        "--kv-persist-dir", str(persist), "--kv-events-config", json.dumps(config),
    ]  # fmt: skip
    return args, replay


def complete(url: str, prompt: list[int], salt: str | None = None) -> None:
    body: dict[str, object] = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt:
        body["cache_salt"] = salt
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def cached_paths(url: str) -> set[tuple[object, tuple[int, ...]]]:
    """The server's cached leaf paths: the snapshot that opens /v1/cache/events."""
    with httpx.stream("GET", f"{url}/v1/cache/events", timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                snap = json.loads(line[5:])
                assert snap["type"] == "snapshot"
                return {(p["namespace"], tuple(p["token_ids"])) for p in snap["paths"]}
    raise AssertionError("no snapshot")


def replayed(replay_endpoint: str) -> tuple[BlockMirror, list[KVEvent]]:
    """Every batch the server kept, from seq 0, applied in order to a fresh mirror."""
    mirror = BlockMirror(WorkerTrie(BS, 4096))
    events: list[KVEvent] = []
    batches = request_replay(replay_endpoint, 0)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    for _, payload in batches:
        for event in decode_batch(payload).events:
            mirror.apply(event)
            events.append(event)
    return mirror, events


def prompts() -> list[tuple[list[int], str | None]]:
    """Twenty 64-token prompts in pairs that share their first two blocks; two salted."""
    out: list[tuple[list[int], str | None]] = []
    for k in range(10):
        shared = [(k * 7 + i) % 97 + 2 for i in range(32)]
        for j in range(2):
            out.append((shared + [(k + j * 13 + i) % 97 + 2 for i in range(32)], None))
    out[3] = (out[3][0], "tenant")
    out[4] = (out[4][0], "tenant")
    return out


def test_server_events_rebuild_its_cache_through_eviction_offload_reset_and_restart(
    tiny_model: Path, tmp_path: Path
) -> None:
    persist = tmp_path / "persist"
    args, replay = serve_args(tiny_model, persist)
    with running_server(*args) as server:
        for prompt, salt in prompts():
            complete(server.url, prompt, salt)
        mirror, events = replayed(replay)
        assert set(mirror.trie.paths()) == cached_paths(server.url)
        media = {(type(e).__name__, getattr(e, "medium", None)) for e in events}
        assert {
            ("BlockStored", "CPU"),
            ("BlockStored", "CPU_OFFLOAD"),  # demoted into the tier
            ("BlockRemoved", "CPU"),
            ("BlockRemoved", "CPU_OFFLOAD"),  # dropped from the full tier
        } <= media
        salted = [e for e in events if isinstance(e, BlockStored) and e.extra_keys]
        assert salted and salted[0].extra_keys[0] == ("tenant",)  # type: ignore[index]

        r = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
        assert r.status_code == 200, r.text
        assert cached_paths(server.url) == set()
        for prompt, salt in prompts()[:6]:
            complete(server.url, prompt, salt)
        mirror, events = replayed(replay)
        assert any(isinstance(e, AllBlocksCleared) for e in events)
        assert set(mirror.trie.paths()) == cached_paths(server.url) != set()
        before = cached_paths(server.url)
    assert any(persist.iterdir()), "the cache was saved at shutdown"

    args, replay = serve_args(tiny_model, persist)
    with running_server(*args) as server:
        after = cached_paths(server.url)
        mirror, events = replayed(replay)
        assert after == before  # everything was restored
        assert set(mirror.trie.paths()) == after
        stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
        assert stored == sum(1 for _ in mirror.blocks)  # one BlockStored per restored block
        assert not any(isinstance(e, BlockRemoved) for e in events)
