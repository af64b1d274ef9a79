"""Sliding-window layers in a window pool of their own (docs/models.md): the windowed layers
keep only the slots their windows read or that a cached prefix needs, yet every greedy token
equals the one pool's (and the cache off's), with slots evicted, hits shortened where a
prefix's window lost its slots, and the invariants after every step."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from radixserve.engine.builder import window_pool
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.stats import cache_stats
from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.weights import quantize_model
from radixserve.values import ceil_div, parse_size
from tests.engine.test_architectures import generate, prompts
from tests.support.models import TINY_WINDOW

WINDOWED = ("gemma3", "mistral", "qwen2")  # local + global, every layer, the top layers
BASE = EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=16)


def long_prompts() -> list[list[int]]:
    """Prompts of 3-12 windows sharing a 40-token head, the shared test prompts among them."""
    rng = random.Random(11)
    head = [rng.randrange(100, 40000) for _ in range(40)]
    extra = [head + [rng.randrange(100, 40000) for _ in range(n)] for n in (3, 30, 57)]
    return [*prompts(), *extra, list(extra[1])]


def run(model, tokenizer: Tokenizer, config: EngineConfig) -> tuple[list, LLMEngine]:
    engine = LLMEngine.from_parts(config, model, tokenizer, "tiny")
    out = generate(engine, long_prompts(), one_by_one=True)
    out += generate(engine, long_prompts(), one_by_one=False)
    return out, engine


@pytest.fixture(scope="module", params=WINDOWED)
def windowed(request, tiny_pair_factory, default_tokenizer):
    _, model = tiny_pair_factory(
        arch=request.param,
        vocab_size=len(default_tokenizer.hf),
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    return request.param, model


def test_a_small_window_pool_gives_the_one_pools_tokens(windowed, default_tokenizer) -> None:
    arch, model = windowed
    # The fewest slots the engine accepts: one request's window plus a step of 16 tokens.
    small = replace(BASE, window_slots=ceil_div(TINY_WINDOW + 16, 4) + 2)
    hybrid, engine = run(model, default_tokenizer, small)
    one_pool, plain = run(model, default_tokenizer, replace(BASE, disable_hybrid_swa_memory=True))
    off, _ = run(model, default_tokenizer, replace(small, enable_prefix_cache=False))
    assert [t for t, _ in hybrid] == [t for t, _ in one_pool] == [t for t, _ in off]
    pool = engine.runner.kv_pool
    windowed_layers = sum(pool.in_window_pool(i) for i in range(model.config.num_layers))
    assert windowed_layers == sum(
        model.config.layer_window(i) is not None for i in range(model.config.num_layers)
    )
    assert plain.runner.kv_pool.window_slots is None
    slots = engine.kv.pool.window
    assert slots is not None and slots.num_slots == small.window_slots
    assert slots.evicted > 0  # the long prompts' early blocks gave their slots away
    assert engine.scheduler.num_preemptions > 0  # every slot pinned: requests made room
    stats = cache_stats(engine.kv)
    assert stats["window_slots_total"] == small.window_slots
    assert stats["window_slots_evicted"] == slots.evicted and stats["window_slots_pinned"] == 0
    assert "window_slots_total" not in cache_stats(plain.kv)
    # Hits still came from the tree, and none of them reads a block without its slot.
    assert sum(c > 0 for _, c in hybrid) >= 6
    assert all(c == 0 for _, c in off)


def test_a_hit_stops_where_the_window_lost_its_slots(windowed, default_tokenizer) -> None:
    arch, model = windowed
    config = replace(BASE, window_slots=ceil_div(TINY_WINDOW + 16, 4) + 2)
    engine = LLMEngine.from_parts(config, model, default_tokenizer, "tiny")
    first, second = long_prompts()[-2], long_prompts()[-3]  # 97 and 70 tokens, 40 shared
    [(tokens, _)] = generate(engine, [first], one_by_one=True)
    window = engine.kv.pool.window
    assert window is not None
    # The tree holds the first prompt whole, but the slots of its early blocks were taken
    # back: a prefix ending there is no hit; one ending at its tail (slots kept) is.
    [(_, path)] = engine.kv.cache.leaf_paths()
    assert list(path[:96]) == first[:96]
    assert engine.kv.cache.peek_prefix(first[:40]) < 40
    assert engine.kv.cache.peek_prefix(first) == len(first) // 4 * 4
    assert window.num_free + window.num_idle == window.num_slots  # nothing runs: none pinned
    engine.kv.check_invariants()
    # The repeat of the first prompt: its tail kept its slots, so it is a full hit.
    [(repeat, cached)] = generate(engine, [first], one_by_one=True)
    assert repeat == tokens and cached == len(first) - 1
    [(again, cached)] = generate(engine, [second], one_by_one=True)
    # The shared 40 tokens' window had lost its slots: no hit that would read them.
    assert cached % 4 == 0 and cached < 40
    fresh = LLMEngine.from_parts(replace(config, enable_prefix_cache=False), model,
                                 default_tokenizer, "tiny")  # fmt: skip
    assert generate(fresh, [second], one_by_one=True)[0][0] == again


def test_the_window_pool_holds_fewer_tokens_than_the_blocks(default_tokenizer, tiny_pair_factory):
    _, model = tiny_pair_factory(
        arch="gemma3", vocab_size=len(default_tokenizer.hf), hidden_size=64,
        intermediate_size=128, max_position_embeddings=512,
    )  # fmt: skip
    config = EngineConfig(block_size=4, kv_cache_memory="1MiB", max_num_batched_tokens=16)
    hybrid = LLMEngine.from_parts(config, model, default_tokenizer, "tiny")
    plain = LLMEngine.from_parts(
        replace(config, disable_hybrid_swa_memory=True), model, default_tokenizer, "tiny"
    )
    a, b = hybrid.runner.kv_pool, plain.runner.kv_pool
    size = sum(t.numel() * t.element_size() for t in (a.k, a.v, a.k_window, a.v_window))
    plain_size = sum(t.numel() * t.element_size() for t in (b.k, b.v, b.k_window, b.v_window))
    assert size <= 2**20 + 2 * a.k.stride(0) * a.k.element_size()  # within the budget
    assert plain_size <= 2**20 + 2 * b.k.stride(0) * b.k.element_size()
    # The same memory holds more tokens of context: half the window slots per block.
    assert a.num_blocks > 1.4 * b.num_blocks
    assert a.window_slots == int(0.5 * a.num_blocks)


@pytest.mark.slow
def test_fused_decode_steps_read_the_window_pool(tiny_pair_factory, default_tokenizer) -> None:
    for arch in WINDOWED:
        _, model = tiny_pair_factory(
            arch=arch, vocab_size=len(default_tokenizer.hf), hidden_size=64,
            intermediate_size=128, max_position_embeddings=512,
        )  # fmt: skip
        quantize_model(model, "int4")
        small = replace(BASE, window_slots=ceil_div(TINY_WINDOW + 16, 4) + 2)
        hybrid, engine = run(model, default_tokenizer, small)
        one_pool, _ = run(model, default_tokenizer, replace(BASE, disable_hybrid_swa_memory=True))
        assert [t for t, _ in hybrid] == [t for t, _ in one_pool], arch
        assert model.decode_layer_weights() is not None  # the decode steps ran in one call


def test_speculative_rows_read_and_write_the_window_pool(windowed, default_tokenizer) -> None:
    """Drafted rows verified through the window pool (their blocks' slots, rolled back when
    rejected) give the tokens decoding without drafts gives, regenerated answers drafted."""
    arch, model = windowed
    spec = json.dumps({"method": "radix", "num_speculative_tokens": 4})
    small = replace(BASE, window_slots=ceil_div(TINY_WINDOW + 16, 4) + 2)
    batch = long_prompts() * 2  # the second round regenerates the first's answers
    outs = {}
    for name, config in (("plain", small), ("spec", replace(small, speculative_config=spec))):
        engine = LLMEngine.from_parts(config, model, default_tokenizer, "tiny")
        outs[name] = [t for t, _ in generate(engine, batch, one_by_one=True)]
        outs[name] += [t for t, _ in generate(engine, batch[:4], one_by_one=False)]
    assert outs["spec"] == outs["plain"]
    assert engine.stats().spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("arch", WINDOWED)
@pytest.mark.parametrize("memory", ["64KiB", "1MiB", "64MiB"])
def test_the_window_pool_is_sized_within_the_memory(tiny_pair_factory, arch, memory) -> None:
    """Blocks and slots split --kv-cache-memory (never fewer slots than one request's window
    and a step), also where every layer is windowed (Mistral: a block id alone costs nothing)."""
    _, model = tiny_pair_factory(arch=arch, max_position_embeddings=512)
    config = EngineConfig(block_size=4, kv_cache_memory=memory, max_num_batched_tokens=16)
    pool = window_pool(config, model.config, torch.device("cpu"), torch.float32, quiet=True)
    assert pool is not None
    least = ceil_div(TINY_WINDOW + 16, 4) + 2
    assert least <= pool.num_slots <= pool.num_blocks
    used = pool.num_blocks * pool.full_block_bytes + pool.num_slots * pool.slot_bytes
    if pool.num_slots > least:
        assert used <= parse_size(memory)
        assert pool.num_slots == int(0.5 * pool.num_blocks)
    assert pool.num_blocks <= 2 * parse_size(memory)  # bounded, even with no full layers
    off = replace(config, disable_hybrid_swa_memory=True)
    assert window_pool(off, model.config, torch.device("cpu"), torch.float32, True) is None


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_on_the_fewest_slots_gives_the_one_pools_tokens(
    windowed, default_tokenizer, seed
) -> None:
    """Prompts of whole blocks and not, sharing heads, repeated (whole-prompt hits copy their
    last block, which allocates while the hit's window must keep its slots), one by one and
    together, on the fewest slots: no error, the one pool's greedy tokens, invariants held."""
    arch, model = windowed
    rng = random.Random(seed)
    heads = [
        [rng.randrange(100, 40000) for _ in range(rng.choice([8, 16, 24, 40]))] for _ in range(3)
    ]
    batch = [
        rng.choice(heads) + [rng.randrange(100, 40000) for _ in range(rng.choice([0, 4, 8, 13]))]
        for _ in range(8)
    ]
    batch += [list(p) for p in rng.sample(batch, 4)]
    small = replace(BASE, window_slots=ceil_div(TINY_WINDOW + 16, 4) + 2)
    engine = LLMEngine.from_parts(small, model, default_tokenizer, "tiny")
    hybrid = generate(engine, batch, one_by_one=True) + generate(engine, batch, one_by_one=False)
    plain = LLMEngine.from_parts(
        replace(small, disable_hybrid_swa_memory=True), model, default_tokenizer, "tiny"
    )
    one_pool = generate(plain, batch, one_by_one=True) + generate(plain, batch, one_by_one=False)
    assert [t for t, _ in hybrid] == [t for t, _ in one_pool]
