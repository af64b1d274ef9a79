"""Sampling controls and log-probs on the tiny model: each as the OpenAI / vLLM field means."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.outputs import RequestOutput
from radixserve.engine.params import SamplingParams
from radixserve.errors import InvalidRequestError
from tests.support import Collector, run_until_idle

PROMPT = list(range(100, 130))
TINY = dict(
    vocab_size=49152,
    hidden_size=32,
    intermediate_size=64,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def run_one(engine, params: SamplingParams, prompt: list[int] = PROMPT) -> RequestOutput:
    col = Collector()
    rid = engine.add_request(prompt, params, on_output=col)
    run_until_idle(engine)
    return col.final(rid)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **kw})


def test_frequency_and_presence_penalties_pick_the_argmax_of_the_penalized_logits(
    make_tiny_engine,
) -> None:
    out = run_one(
        make_tiny_engine(),
        greedy(frequency_penalty=0.05, presence_penalty=0.02, return_logits=True),
    )
    for k, (row, tok) in enumerate(zip(out.logits, out.token_ids, strict=True)):
        adjusted = row.clone()
        for t in set(out.token_ids[:k]):
            adjusted[t] -= 0.05 * out.token_ids[:k].count(t) + 0.02
        assert tok == int(adjusted.argmax())
    plain = run_one(make_tiny_engine(), greedy())
    assert len(set(plain.token_ids)) < len(set(out.token_ids))  # the tiny model repeats


def test_repetition_penalty_counts_prompt_tokens_too(make_tiny_engine) -> None:
    out = run_one(make_tiny_engine(), greedy(repetition_penalty=1.5, return_logits=True))
    for k, (row, tok) in enumerate(zip(out.logits, out.token_ids, strict=True)):
        seen = set(PROMPT) | set(out.token_ids[:k])
        adjusted = row.clone()
        for t in seen:
            adjusted[t] = adjusted[t] / 1.5 if adjusted[t] > 0 else adjusted[t] * 1.5
        assert tok == int(adjusted.argmax())


def test_logit_bias_of_100_forces_its_token(make_tiny_engine) -> None:
    out = run_one(make_tiny_engine(), greedy(logit_bias={4242: 100.0}))
    assert out.token_ids == [4242] * 8


def test_min_tokens_holds_back_stop_tokens_until_reached(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    first = run_one(engine, greedy(max_tokens=1)).token_ids[0]
    stopped = run_one(engine, greedy(stop_token_ids=[first]))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == first
    held = run_one(engine, greedy(stop_token_ids=[first], min_tokens=3, max_tokens=12))
    assert first not in held.token_ids[:3]
    assert len(held.token_ids) > 3


def test_a_logit_bias_token_outside_the_vocabulary_is_a_400(make_tiny_engine) -> None:
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        make_tiny_engine().add_request(PROMPT, greedy(logit_bias={49152: 1.0}))


def test_output_logprobs_equal_a_log_softmax_of_the_model_logits(make_tiny_engine) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=5, return_logits=True)
    out = run_one(make_tiny_engine(), params)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for row, tok, lp in zip(out.logits, out.token_ids, out.logprobs, strict=True):
        ref = torch.log_softmax(row.float(), dim=-1)
        assert lp.token_id == tok
        assert abs(lp.logprob - ref[tok].item()) <= 1e-4
        top = torch.topk(ref, 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4)
        total += lp.logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_prompt_logprobs_equal_transformers_log_softmax_at_every_position(
    make_tiny_engine, tiny_pair_factory
) -> None:
    hf, _ = tiny_pair_factory(**TINY)  # the twin of the engine's tiny model
    out = run_one(make_tiny_engine(max_num_batched_tokens=8), greedy(prompt_logprobs=2))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT) - 1
    for pos, lp in enumerate(out.prompt_logprobs):
        assert lp.token_id == PROMPT[pos + 1]
        assert abs(lp.logprob - ref[pos, PROMPT[pos + 1]].item()) <= 1e-4
        assert [t for t, _ in lp.top] == torch.topk(ref[pos], 2).indices.tolist()


def test_prompt_logprobs_are_the_same_with_the_cache_on_off_and_hit(make_tiny_engine) -> None:
    on, off = make_tiny_engine(), make_tiny_engine(enable_prefix_cache=False)
    params = greedy(prompt_logprobs=1, logprobs=1)
    warm = run_one(on, greedy())  # caches PROMPT's whole blocks
    assert warm.num_cached_tokens == 0
    a, b = run_one(on, params), run_one(off, params)
    assert a.token_ids == b.token_ids
    for x, y in zip(a.prompt_logprobs + a.logprobs, b.prompt_logprobs + b.logprobs, strict=True):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-5
    # The scored request computed its whole prompt; the next one hits the cache again.
    assert a.num_cached_tokens == 0
    assert run_one(on, greedy()).num_cached_tokens == 28
