"""Prefill/decode disaggregation on the engine (engine/handoff.py): a prefill engine's request
ends after its first token with its prompt's K/V; a decode engine takes that K/V into its own
pool and tree, through the wire format, and continues from that token. In float32 the text is
a single engine's, token for token, and nothing leaks on either side."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.handoff import KVHandoff, decode, encode, pool_layout
from radixserve.engine.params import SamplingParams
from radixserve.errors import InvalidRequestError
from tests.support import Collector, run_until_idle

PROMPT = list(range(100, 130))  # 30 tokens: 7 whole blocks of 4 and 2 over


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(engine, prompt: list[int], params: SamplingParams, **kw: object):
    col = Collector()
    rid = engine.add_request(prompt, params, on_output=col, **kw)
    run_until_idle(engine)
    return col.final(rid)


def prefill(engine, prompt: list[int], params: SamplingParams, start: int = 0) -> KVHandoff:
    """The prefill side: the request as asked, ending after its first token, and its handoff
    through the wire format."""
    one = SamplingParams(**{**params.__dict__, "max_tokens": 1})
    out = run(engine, prompt, one, export_kv_from=start)
    assert out.kv_handoff is not None and len(out.token_ids) == 1
    return decode(encode(out.kv_handoff), pool_layout(engine.kv_pool), engine.kv_pool.k.dtype)


def check_clean(engine) -> None:
    engine.kv.check_invariants()
    assert not engine.scheduler.has_work()
    assert engine.kv.num_private_blocks == 0


def takes_nothing_and_computes_the_prompt(single, d, handoff: KVHandoff, n: int) -> None:
    """`d` adds none of `handoff`'s K/V, computes the whole prompt, and gives `single`'s
    tokens."""
    assert d.import_handoff(handoff) == 0
    got = run(d, PROMPT, greedy(n), first_token=handoff.first)
    assert got.token_ids == run(single, PROMPT, greedy(n)).token_ids
    assert got.metrics.num_computed_prompt_tokens == len(PROMPT)
    check_clean(d)


def test_a_handed_over_request_gives_a_single_engines_tokens(make_tiny_engine) -> None:
    single, p, d = make_tiny_engine(), make_tiny_engine(), make_tiny_engine()
    want = run(single, PROMPT, greedy(8))
    handoff = prefill(p, PROMPT, greedy(8))
    assert handoff.token_ids == PROMPT[:28] and handoff.num_blocks == 7
    assert handoff.first.token_id == want.token_ids[0]
    assert d.import_handoff(handoff) == 28
    got = run(d, PROMPT, greedy(8), first_token=handoff.first)
    assert got.token_ids == want.token_ids
    # The decode engine computed the prompt's last 2 tokens only; none came from its own cache
    # before the handoff, and it reports the prefill engine's hit (none).
    assert got.metrics.num_computed_prompt_tokens == 2
    assert got.num_cached_tokens == 0
    for engine in (p, d):
        check_clean(engine)


def test_only_the_blocks_the_decode_engine_lacks_travel(make_tiny_engine) -> None:
    """The decode engine held the first 16 tokens (an earlier turn): 3 blocks travel; a
    second turn on the prefill engine reports its cache hit through the decode engine."""
    single, p, d = make_tiny_engine(), make_tiny_engine(), make_tiny_engine()
    run(d, PROMPT[:16] + [1, 2], greedy(2))
    run(p, PROMPT[:20] + [3], greedy(2))
    start = d.kv.cache.peek_prefix(PROMPT)
    assert start == 16
    want = run(single, PROMPT, greedy(6))
    handoff = prefill(p, PROMPT, greedy(6), start=start)
    assert handoff.num_blocks == 3 and handoff.start == 16
    assert handoff.first.cached_tokens == 20
    assert d.import_handoff(handoff) == 12
    got = run(d, PROMPT, greedy(6), first_token=handoff.first)
    assert got.token_ids == want.token_ids and got.num_cached_tokens == 20
    check_clean(d)


def test_a_handoff_past_an_evicted_prefix_adds_nothing_and_the_request_computes_it(
    make_tiny_engine,
) -> None:
    single, p, d = make_tiny_engine(), make_tiny_engine(), make_tiny_engine()
    run(d, PROMPT[:16] + [1, 2], greedy(2))
    handoff = prefill(p, PROMPT, greedy(5), start=16)
    d.kv.cache.reset()  # the decode engine's 16 tokens are gone before the K/V arrives
    takes_nothing_and_computes_the_prompt(single, d, handoff, 5)


def test_seeded_sampling_and_logprobs_carry_over(make_tiny_engine) -> None:
    """The first token is the prefill engine's draw with its log-probs; the decode engine's
    generator has drawn once for it too, so a seed gives a single engine's tokens."""
    single, p, d = make_tiny_engine(), make_tiny_engine(), make_tiny_engine()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
    want = run(single, PROMPT, params)
    handoff = prefill(p, PROMPT, params)
    assert handoff.first.logprobs is not None
    d.import_handoff(handoff)
    got = run(d, PROMPT, params, first_token=handoff.first)
    assert got.token_ids == want.token_ids
    assert got.logprobs is not None and want.logprobs is not None
    assert got.logprobs[0].token_id == want.token_ids[0]
    assert got.logprobs[0].logprob == pytest.approx(want.logprobs[0].logprob, abs=1e-4)


def test_a_handoff_that_does_not_fit_the_pool_is_refused(make_tiny_engine) -> None:
    p = make_tiny_engine()
    out = run(p, PROMPT, greedy(1), export_kv_from=0)
    data = encode(out.kv_handoff)
    pool = p.kv_pool
    layout = pool_layout(pool)
    with pytest.raises(InvalidRequestError, match="same model, block size and K/V dtype"):
        decode(data, (layout[0] + 1, *layout[1:]), pool.k.dtype)
    with pytest.raises(InvalidRequestError, match="same model"):
        decode(data, layout, torch.bfloat16)
    with pytest.raises(InvalidRequestError, match="truncated"):
        decode(data[:-1], layout, pool.k.dtype)
    with pytest.raises(InvalidRequestError, match="not a radixserve"):
        decode(b"GET / HTTP/1.1", layout, pool.k.dtype)


def test_a_handoff_takes_one_choice(make_tiny_engine) -> None:
    with pytest.raises(InvalidRequestError, match="one choice"):
        params = SamplingParams(max_tokens=2, temperature=0.0, n=2)
        make_tiny_engine().add_request(PROMPT, params, export_kv_from=0)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])  # local + global layers; every layer
def test_sliding_window_models_hand_over_their_last_windows_k_v(
    arch: str, tiny_pair_factory, default_tokenizer
) -> None:
    """With a window pool, the windowed layers' K/V travel for the prompt's last window only,
    into slots of the decode engine's new blocks (the others give theirs back); the text is
    a single engine's and the decode engine computes only the prompt's partial block."""
    from dataclasses import replace

    from radixserve.engine.config import EngineConfig
    from radixserve.engine.engine import LLMEngine
    from radixserve.values import ceil_div
    from tests.support.models import TINY_WINDOW

    _, model = tiny_pair_factory(
        arch=arch, vocab_size=len(default_tokenizer.hf), hidden_size=64, intermediate_size=128,
        max_position_embeddings=512,
    )  # fmt: skip
    base = EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=16)
    config = replace(base, window_slots=ceil_div(TINY_WINDOW + 16, 4) + 2)

    def engine() -> LLMEngine:
        return LLMEngine.from_parts(config, model, default_tokenizer, "tiny")

    single, p, d = engine(), engine(), engine()
    assert d.kv.pool.window is not None
    prompt = [100 + (7 * i) % 3000 for i in range(61)]  # 15 whole blocks, 1 over; window 8
    want = run(single, prompt, greedy(10))
    handoff = prefill(p, prompt, greedy(10))
    assert handoff.window is not None and handoff.num_blocks == 15
    assert handoff.window.blocks == [13, 14]  # the blocks the last window lies in
    assert d.import_handoff(handoff) == 60
    window = d.kv.pool.window
    d.kv.check_invariants()
    assert window.num_pinned == 0  # the imported slots are cached, not held
    got = run(d, prompt, greedy(10), first_token=handoff.first)
    assert got.token_ids == want.token_ids
    assert got.metrics.num_computed_prompt_tokens == 1
    check_clean(d)
    # A decode engine without a window pool cannot take it.
    plain = LLMEngine.from_parts(
        replace(base, disable_hybrid_swa_memory=True), model, default_tokenizer, "tiny"
    )
    with pytest.raises(InvalidRequestError, match="same model"):
        decode(encode(handoff), pool_layout(plain.kv_pool), plain.kv_pool.k.dtype)


def test_a_decode_engine_with_the_cache_off_takes_nothing_and_computes_the_prompt(
    make_tiny_engine,
) -> None:
    single, p, d = (
        make_tiny_engine(),
        make_tiny_engine(),
        make_tiny_engine(enable_prefix_cache=False),
    )
    handoff = prefill(p, PROMPT, greedy(4))
    takes_nothing_and_computes_the_prompt(single, d, handoff, 4)


def test_the_decode_engines_answer_goes_back_to_the_prefill_engine(make_tiny_engine) -> None:
    """With export_kv_from at the prompt's whole blocks, the decode engine's finished output
    carries the K/V it computed past them (the prompt's partial block, the answer); the
    prefill engine takes it in, so a next turn there hits through the answer."""
    single, p, d = make_tiny_engine(), make_tiny_engine(), make_tiny_engine()
    handoff = prefill(p, PROMPT, greedy(9))
    d.import_handoff(handoff)
    got = run(d, PROMPT, greedy(9), first_token=handoff.first, export_kv_from=28)
    back = got.kv_handoff
    assert back is not None and back.start == 28
    history = PROMPT + got.token_ids  # 39 tokens, 38 computed: 9 whole blocks
    assert back.token_ids == history[:36] and back.num_blocks == 2
    layout = pool_layout(p.kv_pool)
    assert p.import_handoff(decode(encode(back), layout, p.kv_pool.k.dtype)) == 8
    assert p.kv.cache.peek_prefix(history) == 36
    nxt = history + [5, 6, 7]
    again = run(p, nxt, greedy(3))
    assert again.num_cached_tokens == 36
    assert again.token_ids == run(single, nxt, greedy(3)).token_ids
    check_clean(p)
