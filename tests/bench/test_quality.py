"""benchmarks/quality.py: the KL and perplexity arithmetic on hand-made log-probs, and the quality
guard: the default path's perplexity within 0.5% of float32's on a fixed text, read through two
real servers' echo + logprobs."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
TEXT = Path("/usr/share/common-licenses/GPL-3")


@pytest.fixture(scope="module")
def tool() -> dict:
    return runpy.run_path(str(SCRIPT), run_name="quality")


def test_kl_is_zero_for_the_same_distribution_and_grows_with_the_difference(tool: dict) -> None:
    kl_top = tool["kl_top"]
    ref = {"a": math.log(0.6), "b": math.log(0.3)}
    assert kl_top(ref, dict(ref)) == pytest.approx(0.0, abs=1e-12)
    near = kl_top(ref, {"a": math.log(0.55), "b": math.log(0.35)})
    far = kl_top(ref, {"a": math.log(0.3), "b": math.log(0.6)})
    # Two buckets plus the rest (0.1 in each): the textbook sum.
    want = 0.6 * math.log(0.6 / 0.3) + 0.3 * math.log(0.3 / 0.6) + 0.1 * math.log(0.1 / 0.1)
    assert far == pytest.approx(want)
    assert 0.0 < near < far


def test_a_token_missing_from_the_variant_takes_its_last_listed_probability(tool: dict) -> None:
    ref = {"a": math.log(0.5), "b": math.log(0.4)}
    var = {"a": math.log(0.5), "c": math.log(0.2)}  # "b" fell out of the variant's list
    want = 0.4 * math.log(0.4 / 0.2) + 0.1 * math.log(0.1 / 0.3)
    assert tool["kl_top"](ref, var) == pytest.approx(want)


def test_compare_reports_perplexity_change_and_top1_agreement(tool: dict) -> None:
    Scores, compare = tool["Scores"], tool["compare"]
    ref = Scores([math.log(0.5)] * 2, [{"x": math.log(0.5)}, {"y": math.log(0.6)}])
    var = Scores([math.log(0.25)] * 2, [{"x": math.log(0.5)}, {"z": math.log(0.6)}])
    c = compare(ref, var)
    assert ref.perplexity == pytest.approx(2.0) and c.perplexity == pytest.approx(4.0)
    assert c.change == pytest.approx(1.0)
    assert c.top1_same == pytest.approx(0.5)


def test_each_variant_runs_the_kv_dtype_its_label_names(tool: dict) -> None:
    """A variant labelled "K/V float32" must ask for float32 K/V: `--kv-cache-dtype auto` is
    16-bit wherever `--dtype auto` runs a quantized model on the CPU."""
    variants = tool["radixserve_variants"](None)
    assert len(variants) >= 3
    for label, cmd, _ in variants[1:]:
        kv = label.rsplit("K/V ", 1)[1]
        assert cmd[cmd.index("--kv-cache-dtype") + 1] == kv, label


@pytest.mark.slow
@pytest.mark.skipif(not TEXT.exists(), reason="Debian's GPL-3 text is not on this machine")
def test_the_default_path_keeps_perplexity_within_half_a_percent_of_float32(tool: dict) -> None:
    wins = tool["windows"](TEXT.read_text(), None, 14, 512)
    ref_cmd, ref_env = tool["radixserve_variants"](None)[0][1:]
    default_cmd = ref_cmd[: ref_cmd.index("--dtype")]
    ref = tool["serve_and_score"](ref_cmd, ref_env, wins, 20)
    default = tool["serve_and_score"](default_cmd, {"RADIXSERVE_PREFILL_PATH": ""}, wins, 20)
    c = tool["compare"](ref, default)
    assert abs(c.change) <= 0.005, f"default path perplexity {c.perplexity:.3f}: {c.change:+.2%}"
    assert c.top1_same >= 0.95
