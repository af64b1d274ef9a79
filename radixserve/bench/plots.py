"""PNG plots (matplotlib, Agg backend): TTFT distribution, TTFT vs prompt length, the
analyzer's shared-prefix histogram and miss-ratio curve."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.bench.report import RequestRecord

if TYPE_CHECKING:
    from radixserve.bench.analyze import Analysis


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    """Lay out, write the PNG, and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _ttfts_ms(records: Sequence[RequestRecord]) -> list[float]:
    return sorted(r.ttft * 1000 for r in records if r.ok and r.ttft is not None)


def plot_ttft_cdf(
    runs: Mapping[str, Sequence[RequestRecord]], path: str | Path, title: str = "TTFT"
) -> Path:
    """Empirical CDF of TTFT, one line per labelled run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, records in runs.items():
        xs = _ttfts_ms(records)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_ttft_vs_prompt(
    runs: Mapping[str, Sequence[RequestRecord]],
    path: str | Path,
    title: str = "TTFT vs prompt length",
) -> Path:
    """Scatter of TTFT against prompt tokens; hollow markers mark requests with cache hits."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "os^D"
    for i, (label, records) in enumerate(runs.items()):
        pts = [
            (r.prompt_tokens, r.ttft * 1000, bool(r.cached_tokens))
            for r in records
            if r.ok and r.ttft is not None and r.prompt_tokens is not None
        ]
        for hit in (False, True):
            sel = [(x, y) for x, y, h in pts if h == hit]
            if not sel:
                continue
            ax.scatter(
                [p[0] for p in sel],
                [p[1] for p in sel],
                marker=markers[i % len(markers)],
                s=22,
                alpha=0.75,
                label=f"{label} ({'cache hit' if hit else 'no hit'})",
                facecolors="none" if hit else None,
                edgecolors=f"C{i}",
                color=f"C{i}",
            )
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_shared_prefix_hist(a: Analysis, path: str | Path) -> Path:
    """Histogram of each request's longest prefix shared with an earlier request."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(a.shared_lengths, bins=min(40, max(5, len(set(a.shared_lengths)))), color="C0")
    ax.set_xlabel("shared prefix with an earlier request (tokens)")
    ax.set_ylabel("requests")
    ax.set_title(f"shared prefixes: {a.redundant_fraction:.0%} of prompt tokens repeated")
    ax.grid(True, alpha=0.3)
    return _save(plt, fig, path)


def plot_miss_ratio_curve(a: Analysis, path: str | Path) -> Path:
    """Projected cache hit ratio (prefill saved) against cache size, replayed with the
    analysis's eviction policy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    mib = [p.capacity_bytes / 2**20 for p in a.curve]
    ax.plot(mib, [p.hit_ratio * 100 for p in a.curve], marker="o", label=f"{a.policy} replay")
    ax.axhline(a.redundant_fraction_block * 100, ls="--", c="gray", label="unbounded cache")
    ax.set_xscale("log")
    ax.set_xlabel(f"cache size (MiB of KV, {a.kv_dtype})")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title("projected hit ratio vs cache size")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_policy_curves(a: Analysis, path: str | Path, title: str = "") -> Path:
    """Replayed hit ratio against cache size, one line per eviction policy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, curve) in enumerate(a.policy_curves.items()):
        mib = [p.capacity_bytes / 2**20 for p in curve]
        ys = [p.hit_ratio * 100 for p in curve]
        ax.plot(mib, ys, marker="os^Dv"[i % 5], label=name, alpha=0.85)
    ax.axhline(a.redundant_fraction_block * 100, ls="--", c="gray", label="unbounded cache")
    ax.set_xscale("log")
    ax.set_xlabel(f"cache size (MiB of KV, {a.kv_dtype})")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title or "hit ratio vs cache size, by eviction policy")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_suite_ratios(rows: list[tuple[str, float, float]], path: str | Path) -> Path:
    """Bars per workload: TTFT p50 speedup and throughput gain of cache on over off."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r[0] for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], width=0.4, label="TTFT p50 speedup")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], width=0.4, label="requests/s gain")
    ax.axhline(1.0, c="gray", lw=1)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("cache on / cache off (x)")
    ax.set_title("prefix cache on vs off")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)
