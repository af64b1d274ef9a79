"""The `pd_burst` workload's report: how the decoding streams fared while long documents were
prefilled, and how long those documents waited for their first token."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from radixserve.bench.report import RequestRecord, percentile


@dataclass
class BurstStats:
    """One run of pd_burst: the stream turns' time per output token and gaps between chunks
    (ms), their cached share of prompt tokens, and the documents' TTFT (ms)."""

    label: str
    stream_requests: int
    tpot_p50_ms: float
    tpot_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    stream_cached_share: float
    burst_requests: int
    burst_ttft_p50_ms: float
    burst_ttft_p99_ms: float


def burst_stats(records: Sequence[RequestRecord], label: str = "") -> BurstStats:
    """The figures of `records` (a pd_burst run's), by their session ids."""
    ok = [r for r in records if r.ok]
    streams = [r for r in ok if r.session_id.startswith("stream-")]
    bursts = [r for r in ok if r.session_id.startswith("burst-")]
    tpot = [t * 1000 for r in streams if (t := r.tpot) is not None]
    itl = [x * 1000 for r in streams for x in r.itl]
    prompt = sum(r.prompt_tokens or 0 for r in streams)
    cached = sum(r.cached_tokens or 0 for r in streams)
    ttft = [r.ttft * 1000 for r in bursts if r.ttft is not None]
    return BurstStats(
        label, len(streams), percentile(tpot, 50), percentile(tpot, 99), percentile(itl, 50),
        percentile(itl, 99), cached / prompt if prompt else math.nan, len(bursts),
        percentile(ttft, 50), percentile(ttft, 99),
    )  # fmt: skip


def format_bursts(stats: Sequence[BurstStats]) -> str:
    """A markdown table, one row per run, and each run's ratio to the first."""
    head = (
        "| server | stream turns | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | streams' cached "
        "share | documents | document TTFT p50 / p99 (ms) |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for s in stats:
        lines.append(
            f"| {s.label} | {s.stream_requests} | {s.tpot_p50_ms:.1f} / {s.tpot_p99_ms:.1f} | "
            f"{s.itl_p50_ms:.1f} / {s.itl_p99_ms:.1f} | {s.stream_cached_share:.1%} | "
            f"{s.burst_requests} | {s.burst_ttft_p50_ms:.0f} / {s.burst_ttft_p99_ms:.0f} |"
        )
    if len(stats) > 1:
        a = stats[0]
        for b in stats[1:]:
            lines.append(
                f"{b.label} / {a.label}: TPOT p99 {b.tpot_p99_ms / a.tpot_p99_ms:.2f}x, ITL p99 "
                f"{b.itl_p99_ms / a.itl_p99_ms:.2f}x, document TTFT p50 "
                f"{b.burst_ttft_p50_ms / a.burst_ttft_p50_ms:.2f}x"
            )
    return "\n".join(lines)


def to_json(stats: Sequence[BurstStats]) -> list[dict[str, Any]]:
    """JSON-ready rows."""
    return [asdict(s) for s in stats]
