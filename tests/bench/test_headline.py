"""The headline table: a rate sweep to the TTFT SLO on both sides, and cost per 1k tokens."""

from __future__ import annotations

import asyncio
import math

from radixserve.bench.headline import Sweep, SweepPoint, headline_table, sweep, sweep_rates
from radixserve.bench.report import Summary
from radixserve.cli import main as cli_main


def summary(ttft_p90: float, tokens: int = 1000, duration: float = 10.0, errors: int = 0):
    pct = {"p50": ttft_p90 / 2, "p90": ttft_p90, "p99": ttft_p90}
    return Summary(10, errors, duration, 1.0, 10.0, tokens - 100, 0, 100, 0.0, pct, pct, pct, pct)


def run_sweep(p90_at, slo: float = 1.0):
    """Sweep with a fake side whose p90 TTFT at a rate is p90_at[side](rate); logs the calls."""
    calls: list[tuple[int, float]] = []

    async def run_at(side: int, rate: float, step: int) -> Summary:
        calls.append((side, rate))
        return summary(p90_at[side](rate))

    return asyncio.run(sweep(run_at, sweep_rates(0.5, 6), slo)), calls


def test_each_side_keeps_the_highest_rate_within_the_slo_and_stops_after_a_miss() -> None:
    (a, b), calls = run_sweep((lambda r: r / 4, lambda r: r))  # A meets 1 s up to 4 req/s
    assert (a.max_rate, b.max_rate) == (4.0, 1.0)
    assert [r for s, r in calls if s == 1] == [0.5, 1.0, 2.0]  # B stopped at its first miss
    assert [r for s, r in calls if s == 0] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert calls[:4] == [(0, 0.5), (1, 0.5), (1, 1.0), (0, 1.0)]  # who goes first alternates


def test_a_failed_request_or_no_answer_is_a_miss() -> None:
    assert not SweepPoint(1.0, 0.1, errors=1, tokens_per_s=10).meets(1.0)
    (a, b), _ = run_sweep((lambda r: math.nan, lambda r: 0.1))
    assert math.isnan(a.max_rate) and b.max_rate == 16.0 and len(a.points) == 1


def test_cost_per_1k_tokens_spreads_the_hourly_price_over_the_tokens_served() -> None:
    sw = Sweep([], SweepPoint(2.0, 0.5, 0, tokens_per_s=1000 / 3.6))
    assert math.isclose(sw.cost_per_1k(price_per_hour=2.0), 2.0 / 1000)
    assert math.isnan(Sweep().cost_per_1k(2.0))


def test_headline_table_puts_the_baseline_first_and_states_slo_and_price() -> None:
    a = Sweep([], SweepPoint(4.0, 0.5, 0, tokens_per_s=200.0))
    b = Sweep([], SweepPoint(1.0, 0.9, 0, tokens_per_s=100.0))
    md = headline_table(("cache on", "cache off"), (0.042, 1.24), (a, b), 2.0, 1.5, 0.25)
    lines = md.splitlines()
    assert lines[0] == "|  | cache off | cache on | gain |"
    assert lines[2] == "| TTFT p50 | 1,240 ms | 42 ms | 29.52x |"
    assert lines[3] == "| max rate (p90 TTFT <= 2 s) | 1 req/s | 4 req/s | 4.00x |"
    assert lines[4] == "| cost per 1k tokens ($1.5/h) | $0.0042 | $0.0021 | 2.00x |"
    none = headline_table(("A", "B"), (0.1, 0.2), (Sweep(), b), 2.0, 1.0, 0.25)
    assert "| < 0.25 req/s |" in none and "| - | -x |" not in none


def test_slo_ttft_without_compare_is_one_clear_error(capsys) -> None:
    rc = cli_main(["bench", "--workload", "rag", "--slo-ttft", "2", "--tokenizer", "none"])
    assert rc == 2
    assert "--slo-ttft sweeps rates of a --workload under --compare A B" in capsys.readouterr().err
