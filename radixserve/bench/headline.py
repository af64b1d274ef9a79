"""The seed's headline table for any workload: TTFT p50, the maximum sustainable request rate
and the cost per 1k tokens, side A against side B (cache on vs off, or two servers).

The maximum sustainable rate comes from a rate sweep: Poisson arrivals at `start`, then
doubling, both sides at each rate one after the other (the side that goes first alternates),
until a side's p90 TTFT exceeds the SLO or a request fails; a side's figure is the highest
rate it met the SLO at (so it is exact to a factor of 2 at most). The cost per 1k tokens is
what an hour of the machine costs, spread over the tokens (prompt + completion) the side
served per second at that rate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from radixserve.bench.load import BenchPlan
from radixserve.bench.report import Summary, ratio, summarize

SWEEP_STEPS = 8  # rates start .. start * 2**7
SWEEP_REQUESTS = 16  # requests per rate when --max-requests is not given


@dataclass
class SweepPoint:
    """One side at one rate: its p90 TTFT, errors and tokens served per second."""

    rate: float
    ttft_p90: float
    errors: int
    tokens_per_s: float

    def meets(self, slo_ttft: float) -> bool:
        """True if every request succeeded and p90 TTFT is within the SLO."""
        return self.errors == 0 and self.ttft_p90 <= slo_ttft


@dataclass
class Sweep:
    """One side's sweep: the points in rate order, and the best one within the SLO."""

    points: list[SweepPoint] = field(default_factory=list)
    best: SweepPoint | None = None

    @property
    def max_rate(self) -> float:
        """The highest rate that met the SLO (NaN if none did)."""
        return self.best.rate if self.best else math.nan

    def cost_per_1k(self, price_per_hour: float) -> float:
        """Dollars per 1k tokens at the best rate (NaN if no rate met the SLO)."""
        if not self.best or self.best.tokens_per_s <= 0:
            return math.nan
        return price_per_hour / 3600 / self.best.tokens_per_s * 1000


def point(rate: float, s: Summary) -> SweepPoint:
    """A sweep point from one run's summary."""
    tokens = (s.prompt_tokens + s.completion_tokens) / max(s.duration, 1e-9)
    return SweepPoint(rate, s.ttft.get("p90", math.nan), s.errors, tokens)


def sweep_rates(start: float, steps: int = SWEEP_STEPS) -> list[float]:
    """`steps` rates from `start`, each twice the one before."""
    return [start * 2**i for i in range(steps)]


async def sweep(
    run_at: Callable[[int, float, int], Awaitable[Summary]],
    rates: Sequence[float],
    slo_ttft: float,
) -> tuple[Sweep, Sweep]:
    """Run both sides (0 and 1) at each rate via `run_at(side, rate, step)` until each side
    misses the SLO; NaN TTFT (nothing answered) counts as a miss."""
    sides = (Sweep(), Sweep())
    live = [True, True]
    for step, rate in enumerate(rates):
        for side in (0, 1) if step % 2 == 0 else (1, 0):
            if not live[side]:
                continue
            p = point(rate, await run_at(side, rate, step))
            sides[side].points.append(p)
            if p.meets(slo_ttft):
                sides[side].best = p
            else:
                live[side] = False
        if not any(live):
            break
    return sides


async def sweep_plan(
    client: httpx.AsyncClient,
    plan: BenchPlan,
    urls: tuple[str, str],
    slo_ttft: float,
    start: float,
    requests: int | None = None,
    progress: bool = True,
) -> tuple[Sweep, Sweep]:
    """Sweep `plan`'s workload at Poisson rates from `start` against both servers; every run
    draws fresh sessions (seed + 100 + step), so no cache has seen its prompts before."""

    async def run_at(side: int, rate: float, step: int) -> Summary:
        load = dataclasses.replace(
            plan.load, rate=rate, max_requests=requests or plan.load.max_requests or SWEEP_REQUESTS
        )
        desc = f"{plan.workload.name} [{'AB'[side]}] {rate:g} req/s"
        res = await dataclasses.replace(plan, load=load).run(
            client, urls[side], 100 + step, progress, desc
        )
        return summarize(res.records, res.duration)

    return await sweep(run_at, sweep_rates(start), slo_ttft)


def _money(x: float) -> str:
    return "-" if math.isnan(x) else f"${x:.4f}"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:,.0f} ms"


def _rate(x: float, first: float) -> str:
    return f"< {first:g} req/s" if math.isnan(x) else f"{x:g} req/s"


def headline_table(
    labels: tuple[str, str],
    ttft_p50: tuple[float, float],
    sweeps: tuple[Sweep, Sweep],
    slo_ttft: float,
    price_per_hour: float,
    start: float,
) -> str:
    """Seed 000's table as Markdown: metric, side B (the baseline), side A, and the gain."""
    a, b = sweeps
    cost = (a.cost_per_1k(price_per_hour), b.cost_per_1k(price_per_hour))
    rows = [
        ("TTFT p50", _ms(ttft_p50[1]), _ms(ttft_p50[0]), ratio(ttft_p50[1], ttft_p50[0])),
        (
            f"max rate (p90 TTFT <= {slo_ttft:g} s)",
            _rate(b.max_rate, start),
            _rate(a.max_rate, start),
            ratio(a.max_rate, b.max_rate),
        ),
        (
            f"cost per 1k tokens (${price_per_hour:g}/h)",
            _money(cost[1]),
            _money(cost[0]),
            ratio(cost[1], cost[0]),
        ),
    ]
    head = ("", labels[1], labels[0], "gain")
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
