"""benchmarks/spec_replay.py: the engine's drafters replayed over recorded answers, and its
oracle, on hand-made token lists (no model)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "spec_replay.py"
SPEC = '{"method": "radix", "num_speculative_tokens": 5}'


@pytest.fixture(scope="module")
def tool() -> dict:
    return runpy.run_path(str(SCRIPT), run_name="spec_replay")


def test_a_regenerated_answer_is_drafted_from_the_first_and_all_accepted(tool: dict) -> None:
    Answer, StepCost, replay = tool["Answer"], tool["StepCost"], tool["replay"]
    prompt, output = list(range(1000, 1040)), list(range(2000, 2030))
    cost = StepCost(base=(10.0, 0.0), row=(2.0, 0.0))
    first = replay([Answer(prompt, output)], SPEC, cost, 1.0)
    both = replay([Answer(prompt, output), Answer(prompt, output)], SPEC, cost, 1.0)
    # Nothing in the first answer repeats, so only the second drafts, and it guesses right.
    assert first.drafted == 0 and first.ratio == 1.0
    assert both.drafted > 20 and both.accepted == both.drafted
    assert both.spec_ms < both.plain_ms
    free = replay([Answer(prompt, output), Answer(prompt, output)], SPEC, cost, 0.0)
    assert free.ratio > both.ratio and free.accepted == both.accepted


def test_the_oracle_drafts_only_what_the_model_accepts(tool: dict) -> None:
    Answer, StepCost, oracle = tool["Answer"], tool["StepCost"], tool["oracle"]
    loop = [7, 8, 9, 10, 11, 12]
    answer = Answer(list(range(100, 110)), [1] + loop * 4)
    r = oracle([answer], 5, 2, StepCost(base=(10.0, 0.0), row=(1.0, 0.0)))
    assert r.drafted == r.accepted > 0
    # The first pass of the loop has no earlier occurrence: decoded one token a step.
    steps = (r.spec_ms - r.accepted * 1.0) / 10.0
    assert steps == len(answer.output) - 1 - r.accepted
