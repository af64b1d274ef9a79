"""The KV offload tier and warm restarts change nothing but speed (tiny random model, fp32)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from test_engine_tiny import Collector, greedy, run_until_idle  # tests/engine is on sys.path

from radixserve.engine.kv_persist import SAVE_FILE
from radixserve.model.kv_tier import TIER_FILE
from radixserve.model.weights import quantize_model

BS = 4


def conversations(seed: int = 0) -> list[list[int]]:
    """Three chats of four turns, interleaved: each turn extends its chat's prompt."""
    rng = random.Random(seed)
    chats = [[rng.randrange(100, 40000) for _ in range(20)] for _ in range(3)]
    prompts = []
    for _turn in range(4):
        for c in chats:
            c += [rng.randrange(100, 40000) for _ in range(9)]
            prompts.append(list(c))
    return prompts


def serve(engine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Run prompts one at a time; (generated tokens, cached prompt tokens) of each."""
    col = Collector()
    out = []
    for p in prompts:
        rid = engine.add_request(p, greedy(3), on_output=col)
        run_until_idle(engine)
        final = col.final(rid)
        out.append((final.token_ids, final.num_cached_tokens))
    return out


_REFERENCE: list[tuple[list[int], int]] = []


@pytest.fixture
def reference(make_tiny_engine) -> list[tuple[list[int], int]]:
    """An unbounded pool: nothing is ever evicted (computed once per session)."""
    if not _REFERENCE:
        _REFERENCE.extend(serve(make_tiny_engine(num_blocks=512), conversations()))
    return _REFERENCE


@pytest.mark.parametrize("where", ["host", "disk"])
def test_tier_gives_the_same_tokens_and_the_unbounded_hits(
    make_tiny_engine, reference, tmp_path: Path, where: str
) -> None:
    kw: dict[str, object] = {"kv_offload_memory": 256 * 1024}
    if where == "disk":
        kw["kv_offload_dir"] = str(tmp_path)
    engine = make_tiny_engine(num_blocks=24, **kw)
    got = serve(engine, conversations())
    assert [t for t, _ in got] == [t for t, _ in reference]
    assert [c for _, c in got] == [c for _, c in reference]  # the tier kept every prefix
    s = engine.stats()
    assert s.prefix_cache_offload_hits_total > 0 and s.offload_blocks_total > 0
    assert (tmp_path / TIER_FILE).exists() == (where == "disk")


def test_without_a_tier_the_small_pool_recomputes(make_tiny_engine, reference) -> None:
    got = serve(make_tiny_engine(num_blocks=24), conversations())
    assert [t for t, _ in got] == [t for t, _ in reference]
    assert sum(c for _, c in got) < sum(c for _, c in reference)


def test_warm_restart_serves_the_saved_prefixes(make_tiny_engine, tmp_path: Path) -> None:
    prompts = conversations()
    first = make_tiny_engine(num_blocks=64, kv_persist_dir=str(tmp_path))
    before = serve(first, prompts[:6])
    snapshot = sorted(first.cache_snapshot(), key=repr)
    first.shutdown()
    assert (tmp_path / SAVE_FILE).exists()

    second = make_tiny_engine(num_blocks=64, kv_persist_dir=str(tmp_path))
    assert not (tmp_path / SAVE_FILE).exists()  # consumed: a crash now restarts cold
    assert sorted(second.cache_snapshot(), key=repr) == snapshot
    again = serve(second, prompts[:6])
    assert [t for t, _ in again] == [t for t, _ in before]
    assert all(c >= len(p) - BS for (_, c), p in zip(again, prompts[:6], strict=True))


def test_warm_restart_into_a_smaller_pool_spills_to_the_tier(
    make_tiny_engine, tmp_path: Path
) -> None:
    prompts = conversations()
    first = make_tiny_engine(num_blocks=128, kv_persist_dir=str(tmp_path))
    before = serve(first, prompts)
    first.shutdown()
    second = make_tiny_engine(
        num_blocks=24, kv_persist_dir=str(tmp_path), kv_offload_memory=256 * 1024
    )
    assert second.stats().blocks_offloaded > 0
    second.kv.check_invariants()
    again = serve(second, prompts[-3:])
    assert [t for t, _ in again] == [t for t, _ in before[-3:]]
    assert all(c >= len(p) - BS for (_, c), p in zip(again, prompts[-3:], strict=True))


def saved(make_tiny_engine, directory: Path) -> Path:
    engine = make_tiny_engine(kv_persist_dir=str(directory))
    serve(engine, conversations()[:3])
    engine.shutdown()
    return directory / SAVE_FILE


def starts_cold(make_tiny_engine, directory: Path, caplog, why: str, **kw: object) -> None:
    with caplog.at_level(logging.WARNING, logger="radixserve.engine.kv_persist"):
        engine = make_tiny_engine(kv_persist_dir=str(directory), **kw)
    assert engine.stats().blocks_cached == 0
    assert why in caplog.text and "starting cold" in caplog.text
    got = serve(engine, conversations()[:1])
    assert got[0][1] == 0


def test_corrupt_save_starts_cold_with_a_warning(make_tiny_engine, tmp_path, caplog) -> None:
    path = saved(make_tiny_engine, tmp_path)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    starts_cold(make_tiny_engine, tmp_path, caplog, "checksum mismatch")


def test_truncated_save_starts_cold_with_a_warning(make_tiny_engine, tmp_path, caplog) -> None:
    path = saved(make_tiny_engine, tmp_path)
    path.write_bytes(path.read_bytes()[:-1000])
    starts_cold(make_tiny_engine, tmp_path, caplog, "truncated")


def test_save_of_another_block_size_is_not_loaded(make_tiny_engine, tmp_path, caplog) -> None:
    saved(make_tiny_engine, tmp_path)
    starts_cold(make_tiny_engine, tmp_path, caplog, "different block_size", block_size=8)


def test_save_of_other_weights_is_not_loaded(
    make_tiny_engine, tiny_pair_factory, default_tokenizer, tmp_path, caplog
) -> None:
    from radixserve.engine.config import EngineConfig
    from radixserve.engine.engine import LLMEngine

    saved(make_tiny_engine, tmp_path)
    _, other = tiny_pair_factory(
        seed=1,
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    cfg = EngineConfig(block_size=BS, num_blocks=64, kv_persist_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="radixserve.engine.kv_persist"):
        engine = LLMEngine.from_parts(cfg, other, default_tokenizer, "other")
    assert engine.stats().blocks_cached == 0
    assert "different weights" in caplog.text


def test_the_weights_hash_covers_quantized_codes(tiny_pair_factory) -> None:
    """A save is keyed by the codes too: int4 and int8 of one checkpoint (same parameters)
    differ, and so does one changed code."""
    from radixserve.engine.kv_persist import weights_hash

    hashes = []
    for kind in ("int4", "int8"):
        _, model = tiny_pair_factory(intermediate_size=128)
        quantize_model(model, kind)
        hashes.append(weights_hash(model))
    assert weights_hash(model) == hashes[-1]  # deterministic
    model.decoder_layers()[0].qkv_lin.weight.qs.view(-1)[0] += 1
    hashes.append(weights_hash(model))
    assert len(set(hashes)) == 3


def test_offload_hits_are_exported_as_a_prometheus_counter(make_tiny_engine) -> None:
    from prometheus_client import generate_latest

    from radixserve.server.metrics import ServerMetrics

    engine = make_tiny_engine(num_blocks=24, kv_offload_memory=256 * 1024)
    serve(engine, conversations())
    text = generate_latest(ServerMetrics(engine).registry).decode()
    hits = engine.stats().prefix_cache_offload_hits_total
    assert hits > 0
    assert f"radixserve_prefix_cache_offload_hits_total {float(hits)}" in text
    assert 'radixserve_cache_offload_blocks{state="total"}' in text


def test_serve_flags_reach_the_engine_config() -> None:
    import argparse

    from radixserve.launch import add_serve_args, run_serve
    from radixserve.server.config import WorkerOptions

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(
        ["--kv-offload-memory", "8GiB", "--kv-offload-dir", "/x", "--kv-persist-dir", "/y"]
    )
    opts = WorkerOptions.from_namespace(args)
    cfg = opts.engine_config()
    assert (cfg.kv_offload_memory, cfg.kv_offload_dir, cfg.kv_persist_dir) == ("8GiB", "/x", "/y")
    # the flags travel to `serve --workers N` workers and Ray replicas too
    assert WorkerOptions.from_dict(opts.to_dict()) == opts
    assert opts.to_argv()[-6:] == [
        "--kv-offload-memory", "8GiB", "--kv-offload-dir", "/x", "--kv-persist-dir", "/y"
    ]  # fmt: skip
    default = WorkerOptions.from_namespace(parser.parse_args([])).engine_config()
    assert default.kv_offload_memory is None
    with pytest.raises(SystemExit):  # a size that is not one is an argparse error
        parser.parse_args(["--kv-offload-memory", "lots"])
    args.workers = 2  # one engine per directory: refused before any worker starts
    with pytest.raises(ValueError, match="one worker"):
        run_serve(args)
