"""Engine behaviour on a tiny random model: admission, memory pressure, aborts, errors."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.cache import CacheFullError
from radixserve.engine.llm import LLM
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.params import SamplingParams
from radixserve.errors import InvalidRequestError, PromptTooLongError, RequestTooLargeError
from tests.support import Collector, run_until_idle, wait_for


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_cached_prefix_is_reported_and_reused(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    col = Collector()
    prompt = list(range(100, 130))
    a = engine.add_request(prompt, greedy(3), on_output=col)
    run_until_idle(engine)
    generated = col.final(a).token_ids
    c = engine.add_request(prompt[:25] + [7, 8, 9], greedy(3), on_output=col)
    run_until_idle(engine)
    b = engine.add_request(prompt + generated + [7, 8, 9], greedy(3), on_output=col)
    run_until_idle(engine)
    assert col.final(a).num_cached_tokens == 0
    assert col.final(c).num_cached_tokens == 24  # 25 shared tokens -> 6 whole blocks
    # a computed 30 prompt + 2 of its 3 generated tokens -> 8 whole blocks of 4.
    assert col.final(b).num_cached_tokens == 32


def test_exact_repeat_recomputes_only_the_last_token_in_a_copy_of_its_block(
    make_tiny_engine,
) -> None:
    """A prompt cached through its last token (it ends on a block boundary) takes all but that
    token from the tree; the last block is copied, so the recomputed token's K/V goes to the
    copy and the tree's block keeps its bytes. Output equals the cache-off engine's."""
    engine = make_tiny_engine()
    col = Collector()
    prompt = list(range(200, 216))  # exactly 4 blocks
    a = engine.add_request(prompt, greedy(4), on_output=col)
    run_until_idle(engine)
    m = engine.kv.cache.match_prefix(prompt, None)
    last = m.blocks[-1]
    before = engine.kv_pool.k[:, last].clone(), engine.kv_pool.v[:, last].clone()
    b = engine.add_request(prompt, greedy(4), on_output=col)
    run_until_idle(engine)
    assert col.final(b).num_cached_tokens == 15
    assert col.final(b).token_ids == col.final(a).token_ids
    assert engine.kv_pool.k[:, last].equal(before[0]) and engine.kv_pool.v[:, last].equal(before[1])
    off = make_tiny_engine(enable_prefix_cache=False)
    col_off = Collector()
    c = off.add_request(prompt, greedy(4), on_output=col_off)
    run_until_idle(off)
    assert col_off.final(c).token_ids == col.final(b).token_ids


def test_exact_repeat_without_a_free_block_for_the_copy_recomputes_the_last_block(
    make_tiny_engine, monkeypatch
) -> None:
    engine = make_tiny_engine()
    col = Collector()
    prompt = list(range(300, 316))
    a = engine.add_request(prompt, greedy(2), on_output=col)
    run_until_idle(engine)
    cache = engine.kv.cache
    allocate = cache.allocate

    def full_once(n: int) -> list[int]:
        monkeypatch.setattr(cache, "allocate", allocate)
        raise CacheFullError(n, 0)

    monkeypatch.setattr(cache, "allocate", full_once)
    b = engine.add_request(prompt, greedy(2), on_output=col)
    run_until_idle(engine)
    assert col.final(b).num_cached_tokens == 12  # no block to copy into: the last is redone
    assert col.final(b).token_ids == col.final(a).token_ids


def test_cache_off_reports_no_cached_tokens(make_tiny_engine) -> None:
    engine = make_tiny_engine(enable_prefix_cache=False)
    col = Collector()
    prompt = list(range(300, 340))
    for _ in range(2):
        rid = engine.add_request(prompt, greedy(2), on_output=col)
        run_until_idle(engine)
        assert col.final(rid).num_cached_tokens == 0
    assert engine.kv.pool.num_free == engine.num_blocks


def test_request_larger_than_pool_is_rejected_and_engine_keeps_serving(make_tiny_engine) -> None:
    engine = make_tiny_engine(num_blocks=16)
    with pytest.raises(RequestTooLargeError):
        engine.add_request(list(range(60)), greedy(10))
    col = Collector()
    rid = engine.add_request(list(range(10)), greedy(2), on_output=col)
    run_until_idle(engine)
    assert col.final(rid).finish_reason == "length"


def test_prompt_longer_than_context_is_rejected(make_tiny_engine) -> None:
    engine = make_tiny_engine(max_model_len=32, num_blocks=64)
    with pytest.raises(PromptTooLongError):
        engine.add_request(list(range(32)), greedy(1))


def test_out_of_vocabulary_token_is_rejected(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    with pytest.raises(InvalidRequestError):
        engine.add_request([1, 2, 10**9], greedy(1))
    with pytest.raises(InvalidRequestError):
        engine.add_request([], greedy(1))


def test_generation_stops_at_max_model_len(make_tiny_engine) -> None:
    engine = make_tiny_engine(max_model_len=20)
    col = Collector()
    rid = engine.add_request(list(range(15)), greedy(50), on_output=col)
    run_until_idle(engine)
    out = col.final(rid)
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_abort_of_waiting_and_running_requests_frees_everything(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    col = Collector()
    r1 = engine.add_request(list(range(40)), greedy(30), on_output=col)
    engine.step()
    engine.step()
    r2 = engine.add_request(list(range(50, 90)), greedy(30), on_output=col)
    engine.abort(r1)
    engine.abort(r2)
    run_until_idle(engine)
    assert col.final(r1).finish_reason == "abort"
    assert col.final(r2).finish_reason == "abort"
    stats = engine.kv.cache.stats()
    assert stats.locked_blocks == 0
    assert engine.kv.pool.num_free + stats.cached_blocks == engine.num_blocks


@pytest.mark.parametrize(
    "eviction",
    [
        {},  # the default policy gets the long run, the others a shorter one (CPU budget)
        {"eviction_policy": "lru"},
        {"eviction_policy": "fanout"},
        {"eviction_policy": "slru"},
        {"eviction_policy": "priority"},
        {"eviction_policy": "slru", "session_ttl": 0.05, "namespace_quota": 0.4},
    ],
    ids=["default", "lru", "fanout", "slru", "priority", "slru-session-quota"],
)
def test_random_workload_under_memory_pressure_keeps_invariants(
    make_tiny_engine, eviction: dict[str, object]
) -> None:
    num_requests = 200 if not eviction else 50
    engine = make_tiny_engine(num_blocks=40, max_num_batched_tokens=48, max_num_seqs=8, **eviction)
    # No aging: the admission order (and so whether anyone is preempted) must not depend on
    # how fast this machine runs the steps.
    engine.scheduler.aging_s = float("inf")
    rng = random.Random(7)
    col = Collector()
    prefixes = [[rng.randrange(1000, 1100) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    submitted: list[str] = []
    for i in range(num_requests):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 40)] + [
            rng.randrange(2000, 2100) for _ in range(rng.randrange(1, 12))
        ]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 16),
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            ignore_eos=True,
        )
        try:
            rid = engine.add_request(
                prompt,
                params,
                on_output=col,
                namespace=rng.choice([None, None, "t1"]),
                priority=rng.randrange(3),
                session_id=rng.choice([None, "s1", "s2"]),
            )
            submitted.append(rid)
        except RequestTooLargeError:
            continue
        if rng.random() < 0.15 and submitted:
            engine.abort(rng.choice(submitted))
        for _ in range(rng.randrange(0, 3)):
            engine.step()
            engine.kv.check_invariants()
    run_until_idle(engine)
    for rid in submitted:
        assert col.final(rid).finish_reason in ("length", "abort")
    s = engine.stats()
    assert s.preemptions_total > 0 or num_requests < 200  # the short runs rarely preempt
    assert s.evicted_blocks_total > 0
    cache = engine.kv.cache.stats()
    assert cache.locked_blocks == 0
    assert engine.kv.pool.num_free + cache.cached_blocks == engine.num_blocks
    assert engine.kv.num_private_blocks == 0


def test_each_requests_metrics_add_up_under_preemption(make_tiny_engine) -> None:
    """RequestMetrics, which the engine alone writes: times in order, the cache hit and the
    computed prompt tokens cover the prompt (exactly, unless a preemption made it recompute),
    one output token per token returned, and the preemptions sum to the engine's count."""
    engine = make_tiny_engine(num_blocks=40, max_num_batched_tokens=48, max_num_seqs=8)
    engine.scheduler.aging_s = float("inf")
    rng = random.Random(3)
    col = Collector()
    shared = [rng.randrange(1000, 1100) for _ in range(24)]
    prompts = {}
    for _ in range(60):
        prompt = shared[: rng.randrange(1, 24)] + [rng.randrange(2000, 2100) for _ in range(8)]
        params = SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.0, ignore_eos=True)
        prompts[engine.add_request(prompt, params, on_output=col)] = prompt
        for _ in range(rng.randrange(0, 3)):
            engine.step()
    run_until_idle(engine)
    preempted = 0
    for rid, prompt in prompts.items():
        out = col.final(rid)
        m = out.metrics
        assert out.finish_reason == "length" and out.num_cached_tokens == m.num_cached_tokens
        assert m.first_scheduled_time is not None and m.first_token_time is not None
        assert m.finish_time is not None
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
        assert m.num_prompt_tokens == len(prompt) and m.num_output_tokens == len(out.token_ids)
        covered = m.num_cached_tokens + m.num_computed_prompt_tokens
        assert covered == len(prompt) if m.num_preemptions == 0 else covered >= len(prompt)
        preempted += m.num_preemptions
    assert preempted == engine.stats().preemptions_total > 0
    assert sum(col.final(r).num_cached_tokens > 0 for r in prompts) > 10


def sample(engine, params: SamplingParams, prompt: list[int] | None = None) -> RequestOutput:
    """The final output of one request run alone on `engine`."""
    col = Collector()
    rid = engine.add_request(prompt or list(range(500, 520)), params, on_output=col)
    run_until_idle(engine)
    return col.final(rid)


def test_seeded_sampling_is_reproducible(make_tiny_engine) -> None:
    outs = []
    for _ in range(2):
        params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=42)
        outs.append(sample(make_tiny_engine(), params).token_ids)
    assert outs[0] == outs[1]


def test_different_seeds_sample_different_tokens(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    outs = [
        tuple(sample(engine, SamplingParams(max_tokens=12, temperature=1.0, seed=s)).token_ids)
        for s in (1, 2, 3)
    ]
    assert len(set(outs)) == 3, outs


def test_temperature_zero_is_greedy_whatever_the_seed(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    outs = []
    for seed in (None, 1, 2):
        params = SamplingParams(
            max_tokens=12, temperature=0.0, top_p=0.9, top_k=50, seed=seed, return_logits=True
        )
        out = sample(engine, params)
        # Greedy by definition: each token is the argmax of the logits it was drawn from.
        assert out.token_ids == [int(row.argmax()) for row in out.logits]
        outs.append(out.token_ids)
    assert outs[0] == outs[1] == outs[2]
    # top_k=1 is the other way to ask for greedy; it must agree.
    assert sample(engine, SamplingParams(max_tokens=12, top_k=1, seed=3)).token_ids == outs[0]


def test_streamed_deltas_add_up_to_the_final_text(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    col = Collector()
    rid = engine.add_request(list(range(600, 610)), greedy(20), on_output=col)
    run_until_idle(engine)
    outs = col.outputs[rid]
    assert "".join(o.new_text for o in outs) == outs[-1].text
    assert sum(len(o.new_token_ids) for o in outs) == len(outs[-1].token_ids) == 20


def test_shared_uncached_prefix_is_computed_once(make_tiny_engine) -> None:
    engine = make_tiny_engine(max_num_batched_tokens=256)
    col = Collector()
    shared = list(range(700, 740))
    a = engine.add_request(shared + [1, 2], greedy(2), on_output=col)
    b = engine.add_request(shared + [3, 4], greedy(2), on_output=col)
    run_until_idle(engine)
    assert col.final(a).num_cached_tokens == 0
    assert col.final(b).num_cached_tokens == 40


def test_offline_generate_takes_more_prompts_than_the_http_queue_limit(make_tiny_engine) -> None:
    engine = make_tiny_engine(num_blocks=256, max_waiting=8)
    with LLM.from_engine(engine) as llm:
        prompts = [[100 + i % 50, 200 + i] for i in range(300)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.finish_reason == "length" for o in outs)


def test_an_error_inside_generate_leaves_the_engine_usable(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    with LLM.from_engine(engine) as llm:
        with pytest.raises(InvalidRequestError):
            llm.generate([[5, 6, 7], [10**9]], SamplingParams(max_tokens=4, temperature=0.0))
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
        assert out[0].finish_reason == "length"
        wait_for(lambda: not engine.stats().num_running, 30, "the engine idle", every=0.01)
        assert engine.stats().blocks_locked == 0
    assert not engine.is_alive()


def _greedy_with_logits(engine, prompts: list[list[int]]) -> list[RequestOutput]:
    col = Collector()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True)
    ids = []
    for p in prompts:  # one by one, so later prompts hit what earlier ones cached
        ids.append(engine.add_request(p, params, on_output=col))
        run_until_idle(engine)
    return [col.final(i) for i in ids]


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
def test_a_half_size_kv_cache_holds_twice_the_tokens_and_hits_equal_recompute(
    make_tiny_engine, backend: str
) -> None:
    """--kv-cache-dtype bfloat16 on a float32 model: the same memory holds twice the blocks,
    and a cache hit still gives the tokens and logits of recomputing (both read the same
    rounded K/V from the pool)."""
    full = make_tiny_engine(num_blocks=None, kv_cache_memory="1MiB", attention_backend=backend)
    half = make_tiny_engine(
        num_blocks=None, kv_cache_memory="1MiB", kv_cache_dtype="bf16", attention_backend=backend
    )
    assert full.kv_cache_dtype == "float32" and half.kv_cache_dtype == "bfloat16"
    assert half.runner.kv_pool.k.dtype == torch.bfloat16
    assert half.num_blocks == 2 * full.num_blocks
    base = list(range(200, 240))
    prompts = [base + [1, 2, 3], base + [4, 5], base + [1, 2, 3], base[:30] + [9]]
    on = _greedy_with_logits(half, prompts)
    off = _greedy_with_logits(
        make_tiny_engine(kv_cache_dtype="bfloat16", enable_prefix_cache=False), prompts
    )
    assert [o.num_cached_tokens for o in on] == [0, 40, 40, 28]
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logits, b.logits, strict=True):
            assert (la - lb).abs().max().item() <= 1e-3
    # Rounding K/V to bfloat16 moves this model's logits a little, not its greedy tokens.
    exact = _greedy_with_logits(full, prompts)
    for a, b in zip(on, exact, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.logits[0] - b.logits[0]).abs().max().item() <= 5e-3


def test_an_unknown_kv_cache_dtype_is_an_error(make_tiny_engine) -> None:
    with pytest.raises(ValueError, match="fp8 KV caches are not supported"):
        make_tiny_engine(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="use one of auto, float32, bfloat16, float16"):
        make_tiny_engine(kv_cache_dtype="int8")


def test_auto_kv_dtype_is_16_bits_only_for_quantized_float32_on_the_cpu_by_default() -> None:
    """auto: the model dtype (vLLM's meaning), except where --dtype auto runs quantized weights
    in float32 on the CPU: bfloat16 where the prefill path's attention already rounds K/V to
    it, float16 where it reads them in float32."""
    from radixserve.model.kernels.matrix import PrefillPath
    from radixserve.model.loader import resolve_kv_cache_dtype

    cpu, f32 = torch.device("cpu"), torch.float32
    q = {"device": cpu, "quantization": "gguf"}
    assert resolve_kv_cache_dtype("auto", f32, **q) == torch.float16
    path = PrefillPath.AMX_BF16  # its attention_unit is never 0
    assert resolve_kv_cache_dtype("auto", f32, prefill_path=path, **q) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", f32, dtype_name="float32", **q) == f32
    assert resolve_kv_cache_dtype("auto", f32, device=cpu) == f32  # dense weights
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, **q) == torch.bfloat16
    assert (
        resolve_kv_cache_dtype("auto", f32, device=torch.device("cuda"), quantization="int8") == f32
    )
    assert resolve_kv_cache_dtype("fp32", f32, **q) == f32  # an explicit dtype is kept
