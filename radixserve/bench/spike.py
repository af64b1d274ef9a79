"""The `spike` workload's report: did the hot prefixes stay cached through the burst?"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from radixserve.bench.report import RequestRecord, percentile


@dataclass
class PhaseStats:
    """The hot (steady) requests of one phase: pre, burst or post."""

    phase: str
    requests: int
    hot_hit_ratio: float  # cached tokens of the hot prefix / its cacheable tokens
    ttft_p50_ms: float
    ttft_p99_ms: float


def _hot_key(session_id: str) -> tuple[str, str] | None:
    phase, _, rest = session_id.partition("-")
    hot = rest.split("-")[0]
    return (phase, hot) if hot.startswith("h") else None


def phase_stats(
    records: Sequence[RequestRecord], hot_prefix_tokens: Mapping[str, int], block_size: int
) -> list[PhaseStats]:
    """Per phase, how much of each steady request's hot prefix came from the cache, and
    the TTFT of those requests; then the same over all phases ("all")."""
    groups: dict[str, list[tuple[RequestRecord, int]]] = {"pre": [], "burst": [], "post": []}
    for r in records:
        key = _hot_key(r.session_id)
        if key is None or not r.ok or key[0] not in groups:
            continue
        # the last token of the prefix may merge with what follows: count whole blocks before it
        cacheable = (hot_prefix_tokens[key[1]] - 1) // block_size * block_size
        groups[key[0]].append((r, cacheable))
    groups["all"] = [x for g in list(groups.values()) for x in g]
    out = []
    for phase, items in groups.items():
        want = sum(c for _, c in items)
        got = sum(min(r.cached_tokens or 0, c) for r, c in items)
        ttfts = [r.ttft * 1000 for r, _ in items if r.ttft is not None]
        out.append(
            PhaseStats(
                phase,
                len(items),
                got / want if want else 0.0,
                percentile(ttfts, 50) if ttfts else 0.0,
                percentile(ttfts, 99) if ttfts else 0.0,
            )
        )
    return out


def format_phases(stats: Sequence[PhaseStats], refetched: int, evicted: int) -> str:
    """The table `radixserve bench --workload spike` prints."""
    lines = ["phase   hot requests  hot-prefix hit ratio  TTFT p50 (ms)  TTFT p99 (ms)"]
    for s in stats:
        lines.append(
            f"{s.phase:<7} {s.requests:>12}  {s.hot_hit_ratio:>20.1%}  "
            f"{s.ttft_p50_ms:>13.0f}  {s.ttft_p99_ms:>13.0f}"
        )
    lines.append(
        f"blocks evicted: {evicted}, refetched (re-prefilled soon after eviction): {refetched}"
    )
    return "\n".join(lines)


def to_json(stats: Sequence[PhaseStats], refetched: int, evicted: int) -> dict[str, object]:
    """The report as JSON-ready values."""
    return {
        "phases": [asdict(s) for s in stats],
        "refetch_blocks": refetched,
        "evicted_blocks": evicted,
    }
