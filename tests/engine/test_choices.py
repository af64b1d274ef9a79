"""n > 1 and best_of: one prefill shared through the tree, a copy of the partial block each."""

from __future__ import annotations

from radixserve.engine.params import SamplingParams
from tests.support import Collector, run_until_idle

PROMPT = list(range(200, 230))  # 30 tokens: 7 whole blocks of 4 and a partial one


def sampled(n: int, seed: int | None = 5, **kw) -> SamplingParams:
    fields = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, **kw}
    return SamplingParams(seed=seed, n=n, **fields)


def test_n_choices_prefill_the_prompt_once_and_copy_only_its_partial_block(
    make_tiny_engine,
) -> None:
    engine = make_tiny_engine()
    col = Collector()
    rid = engine.add_request(PROMPT, sampled(4), on_output=col)
    copies = []
    original = engine.kv.copy_block

    def spy(src: int, dst: int) -> None:
        copies.append(src)
        original(src, dst)

    engine.kv.copy_block = spy
    run_until_idle(engine)  # checks the cache invariants after every step
    choices = col.choices(rid)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    computed = [c.metrics.num_computed_prompt_tokens for c in choices]
    assert computed == [30, 1, 1, 1]  # the leader's prefill; each follower its last token
    assert [c.num_cached_tokens for c in choices[1:]] == [29, 29, 29]
    assert len(copies) == 3 and len(set(copies)) == 1  # the leader's partial block, 3 times
    assert len({tuple(c.token_ids) for c in choices}) == 4
    assert engine.stats().prompt_tokens_total == 30
    assert engine.stats().requests_total == {"length": 1}


def test_each_seeded_choice_is_reproducible_and_choice_0_equals_n_1(make_tiny_engine) -> None:
    def tokens(n: int) -> list[list[int]]:
        engine, col = make_tiny_engine(), Collector()
        rid = engine.add_request(PROMPT, sampled(n), on_output=col)
        run_until_idle(engine)
        return [c.token_ids for c in col.choices(rid)]

    four = tokens(4)
    assert tokens(4) == four
    assert tokens(1) == four[:1]


def test_choices_without_the_cache_each_prefill_and_agree_with_it(make_tiny_engine) -> None:
    engine, col = make_tiny_engine(enable_prefix_cache=False), Collector()
    rid = engine.add_request(PROMPT, sampled(3), on_output=col)
    run_until_idle(engine)
    off = col.choices(rid)
    assert [c.metrics.num_computed_prompt_tokens for c in off] == [30, 30, 30]
    engine, col = make_tiny_engine(), Collector()
    rid = engine.add_request(PROMPT, sampled(3), on_output=col)
    run_until_idle(engine)
    assert [c.token_ids for c in col.choices(rid)] == [c.token_ids for c in off]


def test_best_of_returns_the_n_most_likely_choices_best_first(make_tiny_engine) -> None:
    engine, col = make_tiny_engine(), Collector()
    rid = engine.add_request(PROMPT, sampled(2, best_of=5), on_output=col)
    run_until_idle(engine)
    outs = col.outputs[rid]
    assert all(o.finished for o in outs)  # nothing streams before the ranking
    best = col.choices(rid)
    assert len(best) == 2
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    # The two returned are the best two of five drawn: compare with all five, unranked.
    engine, col = make_tiny_engine(), Collector()
    rid = engine.add_request(PROMPT, sampled(5, logprobs=0), on_output=col)
    run_until_idle(engine)
    drawn = sorted((c.cumulative_logprob for c in col.choices(rid)), reverse=True)
    assert [b.cumulative_logprob for b in best] == drawn[:2]


def test_aborting_a_request_aborts_every_choice(make_tiny_engine) -> None:
    engine, col = make_tiny_engine(), Collector()
    rid = engine.add_request(PROMPT, sampled(3, max_tokens=50), on_output=col)
    for _ in range(3):
        engine.step()
    engine.abort(rid)
    run_until_idle(engine)
    assert [c.finish_reason for c in col.choices(rid)] == ["abort"] * 3
    assert engine.kv.pool.num_free + engine.kv.cache.stats().evictable_blocks == engine.num_blocks


def test_llm_generate_takes_one_params_per_prompt_with_each_prompts_own_choices(
    make_tiny_engine,
) -> None:
    import pytest

    from radixserve.engine.llm import LLM

    llm = LLM.from_engine(make_tiny_engine())
    try:
        prompts = [PROMPT, PROMPT[:20], PROMPT[:10]]
        params = [sampled(2), sampled(1, max_tokens=3), sampled(3, max_tokens=5)]
        outs = llm.generate(prompts, params)
        assert [(o.prompt_token_ids, o.index, len(o.token_ids)) for o in outs] == [
            (PROMPT, 0, 6), (PROMPT, 1, 6), (PROMPT[:20], 0, 3),
            (PROMPT[:10], 0, 5), (PROMPT[:10], 1, 5), (PROMPT[:10], 2, 5),
        ]  # fmt: skip
        alone = llm.generate([PROMPT[:10]], sampled(3, max_tokens=5))
        assert [o.token_ids for o in alone] == [o.token_ids for o in outs[3:]]
        with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
            llm.generate(prompts, params[:2])
        assert llm.engine.stats().num_running == 0  # the refused call added nothing
    finally:
        llm.shutdown()
