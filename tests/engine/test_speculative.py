"""Speculative decoding on the tiny random model: the output is exactly the output without it.

Greedy rows must give the same tokens token for token (float32, one decode row per drafted
token through the same kernels), seeded rows the same draws, unseeded rows the same
distribution; stop strings, max_tokens, grammars and preemption behave as without drafts.
Each test also checks that drafts were made and accepted, so none passes by never drafting.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from radixserve.engine.engine import LLMEngine
from radixserve.engine.params import SamplingParams
from radixserve.engine.structured import StructuredOutput
from tests.support import Collector, run_until_idle

Make = Callable[..., LLMEngine]


def spec(method: str = "radix", k: int = 4) -> str:
    return json.dumps({"method": method, "num_speculative_tokens": k})


def prompts(seed: int = 0, count: int = 6) -> list[list[int]]:
    """Random prompts, the first one repeated at the end (a regenerated answer), and one
    that repeats a phrase (prompt lookup's case)."""
    rng = random.Random(seed)
    out = [[rng.randrange(100, 5000) for _ in range(rng.randrange(5, 40))] for _ in range(count)]
    phrase = [rng.randrange(100, 5000) for _ in range(6)]
    return [*out, phrase * 4, out[0]]


def run_each(engine: LLMEngine, params: SamplingParams, ps: list[list[int]]) -> list[list[int]]:
    """Each prompt's output tokens, one request after another (so later ones hit the cache)."""
    col = Collector()
    ids = []
    for p in ps:
        ids.append(engine.add_request(p, params, on_output=col))
        run_until_idle(engine)
    return [col.final(i).token_ids for i in ids]


def run_together(engine: LLMEngine, params: SamplingParams, ps: list[list[int]]) -> list[Any]:
    """Every prompt at once; their final outputs."""
    col = Collector()
    ids = [engine.add_request(p, params, on_output=col) for p in ps]
    run_until_idle(engine)
    return [col.final(i) for i in ids]


def accepted(engine: LLMEngine) -> int:
    return engine.stats().spec_decode_num_accepted_tokens


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("method", ["ngram", "suffix", "radix"])
@pytest.mark.parametrize("cache", [True, False], ids=["cache-on", "cache-off"])
def test_greedy_output_equals_decoding_without_drafts(
    make_tiny_engine: Make, method: str, cache: bool
) -> None:
    ps = prompts()
    plain = run_each(make_tiny_engine(enable_prefix_cache=cache), GREEDY, ps)
    engine = make_tiny_engine(enable_prefix_cache=cache, speculative_config=spec(method))
    assert run_each(engine, GREEDY, ps) == plain
    s = engine.stats()
    assert s.spec_decode_num_drafts > 0 and 0 < accepted(engine) <= s.spec_decode_num_draft_tokens
    assert engine.kv.num_private_blocks == 0


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
def test_on_int8_vnni_greedy_output_equals_decoding_without_drafts(
    tiny_pair_factory, default_tokenizer, together: bool
) -> None:
    """int8-vnni (the default on CPUs with AVX-512 VNNI and no AMX) decodes with int8
    activations: a drafted row, one of up to 16 in its step, still computes exactly what it
    would alone, so speculation changes no token (int4 codes, the fused decode step; every
    request at once too: several sequences' rows share verification steps)."""
    from radixserve.engine.config import EngineConfig
    from radixserve.model import kernels
    from radixserve.model.kernels import matrix
    from radixserve.model.kernels.matrix import PrefillPath
    from radixserve.model.weights import quantize_model

    if not kernels.load() or PrefillPath.INT8_VNNI not in matrix.available_paths():
        pytest.skip("this CPU or build does not run int8-vnni")
    _, model = tiny_pair_factory(
        vocab_size=49152, hidden_size=64, intermediate_size=128, tie_word_embeddings=True,
        max_position_embeddings=1024,
    )  # fmt: skip
    quantize_model(model, "int4")
    model.use_prefill_path(PrefillPath.INT8_VNNI)

    def make(**kw: Any) -> LLMEngine:
        cfg = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64, **kw)
        return LLMEngine.from_parts(cfg, model, default_tokenizer, "tiny-int4")

    ps = prompts(seed=2)
    run = run_together if together else run_each
    plain = make()
    assert plain.runner.model.prefill_path is PrefillPath.INT8_VNNI
    want = run(plain, GREEDY, ps)
    engine = make(speculative_config=spec("radix"))
    got = run(engine, GREEDY, ps)
    if together:
        want, got = [o.token_ids for o in want], [o.token_ids for o in got]
    assert got == want
    assert accepted(engine) > 0


def test_a_regenerated_answer_is_drafted_from_the_tree_and_mostly_accepted(
    make_tiny_engine: Make,
) -> None:
    """The second run of a prompt walks the first one's cached path: its continuation is the
    whole answer, so nearly every drafted token is accepted."""
    p = prompts()[1]
    engine = make_tiny_engine(speculative_config=spec("radix", 6))
    first = run_each(engine, GREEDY, [p])[0]
    before = engine.stats()
    second = run_each(engine, GREEDY, [p])[0]
    s = engine.stats()
    drafted = s.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    kept = s.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert second == first
    assert drafted >= 30 and kept >= 0.9 * drafted


def test_speculation_reports_drafts_per_request(make_tiny_engine: Make) -> None:
    p = prompts()[2]
    engine = make_tiny_engine(speculative_config=spec("radix"))
    col = Collector()
    for _ in range(2):
        rid = engine.add_request(p, GREEDY, on_output=col)
        run_until_idle(engine)
    m = col.final(rid).metrics
    assert 0 < m.num_accepted_tokens <= m.num_draft_tokens


def test_greedy_output_is_unchanged_under_preemption(make_tiny_engine: Make) -> None:
    """A pool too small for every request at once: requests are preempted and recomputed,
    with drafts in flight, and still produce the tokens they produce alone."""
    ps = prompts(seed=3)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    small = dict(num_blocks=40, max_num_batched_tokens=32)
    plain = [o.token_ids for o in run_together(make_tiny_engine(**small), params, ps)]
    engine = make_tiny_engine(**small, speculative_config=spec("radix"))
    assert [o.token_ids for o in run_together(engine, params, ps)] == plain
    assert engine.scheduler.num_preemptions > 0 and accepted(engine) > 0


def test_seeded_sampling_draws_the_same_tokens(make_tiny_engine: Make) -> None:
    """A seeded row's generator advances once per kept token, as without drafts."""
    ps = prompts(seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True)
    plain = run_each(make_tiny_engine(), params, ps)
    engine = make_tiny_engine(speculative_config=spec("radix"))
    assert run_each(engine, params, ps) == plain
    assert accepted(engine) > 0


def test_a_stop_string_inside_an_accepted_run_ends_the_output_there(
    make_tiny_engine: Make,
) -> None:
    """The stop string is the text of a token the regenerated answer accepts as a draft:
    the output ends before it, as without drafts, and nothing after it is emitted."""
    p = prompts()[1]
    engine = make_tiny_engine(speculative_config=spec("radix", 8))
    col = Collector()
    engine.add_request(p, GREEDY, on_output=col)
    run_until_idle(engine)
    text = col.outputs[next(iter(col.outputs))][-1].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and text.find(stop) > 0
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    plain = run_together(make_tiny_engine(), params, [p])[0]
    before = accepted(engine)
    out = run_together(engine, params, [p])[0]
    assert (out.text, out.token_ids, out.finish_reason) == (
        plain.text,
        plain.token_ids,
        plain.finish_reason,
    )
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    assert accepted(engine) - before > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_is_never_exceeded(make_tiny_engine: Make, max_tokens: int) -> None:
    p = prompts()[1]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = make_tiny_engine(speculative_config=spec("radix", 8))
    run_each(engine, GREEDY, [p])
    out = run_together(engine, params, [p])[0]
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    assert out.token_ids == run_together(make_tiny_engine(), params, [p])[0].token_ids


def test_a_grammar_masks_every_drafted_row(make_tiny_engine: Make) -> None:
    """A constrained request drafts only what its grammar allows, each verified row gets the
    mask of its own position, and the output equals the undrafted one."""
    structured = StructuredOutput.choice(["alpha beta gamma delta", "alpha beta zeta"])
    params = SamplingParams(max_tokens=20, temperature=0.0, structured=structured)
    p = prompts()[2]
    plain = run_each(make_tiny_engine(), params, [p, p])
    engine = make_tiny_engine(speculative_config=spec("radix", 4))
    out = run_each(engine, params, [p, p])
    assert out == plain
    assert accepted(engine) > 0


def test_resetting_the_cache_forgets_stored_outputs(make_tiny_engine: Make) -> None:
    engine = make_tiny_engine(speculative_config=spec("suffix"))
    run_each(engine, GREEDY, [prompts()[1]])
    assert engine._speculator is not None and engine._speculator.suffixes is not None
    assert engine._speculator.suffixes.num_tokens > 0
    engine.reset_prefix_cache()
    assert engine._speculator.suffixes.num_tokens == 0


def _chi_square_p_value(observed: Counter[Any], expected: Counter[Any]) -> float:
    """p-value of a two-sample chi-square test of two count tables (Wilson-Hilferty's
    normal approximation of the chi-square tail, good to a few per cent for df >= 3)."""
    keys = sorted(set(observed) | set(expected), key=repr)
    n1, n2 = sum(observed.values()), sum(expected.values())
    k1, k2 = math.sqrt(n2 / n1), math.sqrt(n1 / n2)
    stat, df = 0.0, -1
    for key in keys:
        a, b = observed.get(key, 0), expected.get(key, 0)
        stat += (k1 * a - k2 * b) ** 2 / (a + b)
        df += 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.slow
def test_sampled_distribution_is_the_models_own(make_tiny_engine: Make) -> None:
    """Unseeded sampling at temperature 1 (top-k 3): the first three tokens' joint counts with
    drafts (from the tree: the greedy answer, accepted about as often as it is likely) match
    those without, by a chi-square test (p > 0.001)."""
    p = prompts()[1]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    n = 1500

    def counts(engine: LLMEngine) -> Counter[tuple[int, ...]]:
        run_each(engine, GREEDY, [p])  # the greedy answer goes into the tree
        got: Counter[tuple[int, ...]] = Counter()
        for _ in range(n // 5):  # 5 at a time: 5 rows + 10 drafts fit a step's 16 exact rows
            got.update(tuple(o.token_ids) for o in run_together(engine, params, [p] * 5))
        return got

    engine = make_tiny_engine(num_blocks=256, speculative_config=spec("radix", 2))
    with_drafts = counts(engine)
    without = counts(make_tiny_engine(num_blocks=256))
    assert accepted(engine) > n // 20
    assert len(without) >= 4
    assert _chi_square_p_value(with_drafts, without) > 0.001
