"""A/B comparison of two servers and the standard suite (every workload, cache on vs off).

The two servers are driven alternately, never at the same time: on a small machine they share
the same cores, and overlapping loads would measure contention instead of the cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from radixserve.bench.analyze import ChatTokenizer, analyze_tokens, read_trace, tokenize
from radixserve.bench.client import check_loopback, fetch_model, make_client
from radixserve.bench.load import BenchPlan, LoadConfig, RunPlan
from radixserve.bench.plots import plot_suite_ratios, plot_ttft_cdf, plot_ttft_vs_prompt
from radixserve.bench.report import (
    RequestRecord,
    Summary,
    format_compare,
    markdown_table,
    ratio,
    summarize,
)
from radixserve.bench.servers import ServerProcess, radixserve_command
from radixserve.bench.workloads import SUITE_WORKLOADS, WORKLOADS, make_workload

# Concurrency per workload in the suite: sessions interleave where a workload has them.
SUITE_CONCURRENCY = {"multi_turn": 4, "rag": 2, "few_shot": 2, "agent": 4, "unique": 2}
SUITE_KV_MEMORY = "1GiB"  # per server, unless --server-args sets --kv-cache-memory
# Workload fields that count requests or sessions (scaled by --scale; token sizes are not).
COUNT_FIELDS = ("requests", "conversations", "agents")


@dataclass
class CompareResult:
    """Both sides of an A/B run: records, summaries and side A's trace."""

    labels: tuple[str, str]
    records: tuple[list[RequestRecord], list[RequestRecord]]
    summaries: tuple[Summary, Summary]
    trace: list[dict[str, Any]]
    params: dict[str, Any] = dataclasses.field(default_factory=dict)  # the workload's sizes
    load: str = ""  # how it was driven

    def table(self) -> str:
        """The side-by-side plain-text table with A/B ratios."""
        return format_compare(*self.summaries, *self.labels)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (records included)."""
        return {
            label: {
                "summary": s.to_json(),
                "records": [dataclasses.asdict(r) for r in recs],
            }
            for label, s, recs in zip(self.labels, self.summaries, self.records, strict=True)
        }


async def warmup(client: httpx.AsyncClient, base_url: str, model: str | None) -> None:
    """One tiny request so lazy initialisation is not charged to the first measured one."""
    model = model or await fetch_model(client, base_url)
    body = {"model": model, "prompt": "Warm-up.", "max_tokens": 2, "temperature": 0.0}
    r = await client.post(f"{base_url}/v1/completions", json=body)
    r.raise_for_status()


async def compare(
    client: httpx.AsyncClient,
    plan: RunPlan,
    urls: tuple[str, str],
    labels: tuple[str, str] = ("A", "B"),
    rounds: int = 1,
    progress: bool = True,
    first: int = 0,
) -> CompareResult:
    """Run `plan` against both servers, one after the other, `rounds` times (round r uses seed
    + r, so a cache never sees a round's prompts before it starts); the side that goes first
    alternates between rounds, starting with side `first`."""
    recs: tuple[list[RequestRecord], list[RequestRecord]] = ([], [])
    durations = [0.0, 0.0]
    trace: list[dict[str, Any]] = []
    for r in range(rounds):
        order = (0, 1) if (r + first) % 2 == 0 else (1, 0)
        for side in order:
            desc = f"{plan.workload.name} [{labels[side]}]"
            res = await plan.run(client, urls[side], r, progress, desc)
            recs[side].extend(res.records)
            durations[side] += res.duration
            if side == 0:
                trace.extend(res.trace)
    sums = (summarize(recs[0], durations[0]), summarize(recs[1], durations[1]))
    return CompareResult(labels, recs, sums, trace, plan.workload.params(), plan.load.describe())


def suite_plan(
    name: str, scale: float = 1.0, params: dict[str, str] | None = None, **plan_kw: Any
) -> BenchPlan:
    """The suite's plan for one workload: default sizes, counts scaled by `scale`, then the
    `params` this workload has (e.g. `max_tokens`) overridden."""
    w = make_workload(name)
    for f in COUNT_FIELDS:
        if hasattr(w, f):
            setattr(w, f, max(1, round(getattr(w, f) * scale)))
    own = {k: v for k, v in (params or {}).items() if hasattr(w, k)}
    w = dataclasses.replace(w, **{k: int(v) for k, v in own.items()})
    plan_kw.setdefault("extra_body", {"ignore_eos": True})  # both sides decode max_tokens
    return BenchPlan(w, LoadConfig(concurrency=SUITE_CONCURRENCY.get(name, 2)), **plan_kw)


def write_run_files(
    out: Path, name: str, res: CompareResult, tokenizer: ChatTokenizer | None
) -> dict[str, Any]:
    """Per-workload JSON, trace, plots and (with a tokenizer) the analyzer's prediction."""
    (out / f"{name}.json").write_text(json.dumps(res.to_json(), indent=1))
    trace_path = out / f"{name}.trace.jsonl"
    trace_path.write_text("".join(json.dumps(e) + "\n" for e in res.trace))
    runs = dict(zip(res.labels, res.records, strict=True))
    plot_ttft_cdf(runs, out / f"{name}_ttft_cdf.png", f"{name}: TTFT")
    plot_ttft_vs_prompt(runs, out / f"{name}_ttft_vs_prompt.png", f"{name}: TTFT vs prompt")
    extra: dict[str, Any] = {}
    if tokenizer is not None:
        a = analyze_tokens(tokenize(read_trace(trace_path), tokenizer), capacities=[])
        extra = {"redundant": a.redundant_fraction, "redundant_block": a.redundant_fraction_block}
    return extra


def suite_markdown(
    results: dict[str, CompareResult],
    extras: dict[str, dict[str, Any]],
    command: str,
    servers: Sequence[str] = (),
) -> str:
    """The Markdown report: what ran, on what, and cache on vs off per workload."""

    def ms(s: Summary, k: str) -> str:
        return f"{s.ttft[k] * 1000:.0f}"

    rows = []
    for name, res in results.items():
        on, off = res.summaries
        red = extras.get(name, {}).get("redundant")
        rows.append(
            [
                name,
                f"{on.prompt_tokens / max(1, on.requests - on.errors):.0f}",
                "-" if red is None else f"{red:.0%}",
                f"{on.cache_hit_ratio:.0%}",
                f"{ms(on, 'p50')} / {ms(off, 'p50')}",
                ratio(off.ttft["p50"], on.ttft["p50"]),
                f"{ms(on, 'p99')} / {ms(off, 'p99')}",
                ratio(off.ttft["p99"], on.ttft["p99"]),
                f"{on.requests_per_s:.2f} / {off.requests_per_s:.2f}",
                ratio(on.requests_per_s, off.requests_per_s),
                f"{on.output_tokens_per_s:.1f} / {off.output_tokens_per_s:.1f}",
                f"{on.errors + off.errors}",
            ]
        )
    header = [
        "workload",
        "prompt tok (mean)",
        "repeated prefix (analyze)",
        "hit ratio (on)",
        "TTFT p50 on / off (ms)",
        "p50 speedup",
        "TTFT p99 on / off (ms)",
        "p99 speedup",
        "req/s on / off",
        "req/s gain",
        "output tok/s on / off",
        "errors",
    ]
    lines = [
        "## Performance: prefix cache on vs off",
        "",
        f"Produced by `{command}` on {platform.machine()} with {os.cpu_count()} CPUs "
        f"({platform.platform()}, Python {platform.python_version()}), "
        f"{time.strftime('%Y-%m-%d')}. Both servers ran on the same machine and were driven "
        "one at a time, with `ignore_eos` so both decode exactly `max_tokens` per request. "
        "Speedup = off / on for latency, on / off for throughput.",
        "",
        markdown_table(header, rows),
        "",
        *(f"- {label}: `{cmd}`" for label, cmd in zip(("on", "off"), servers, strict=False)),
        "",
        "Workloads (sizes in tokens, seed-deterministic text from the Python stdlib):",
        "",
    ]
    for name, res in results.items():
        params = ", ".join(f"{k}={v}" for k, v in res.params.items())
        lines.append(f"- `{name}` — {WORKLOADS[name].summary} ({params}; {res.load})")
    lines += ["", "![cache on vs off](suite_ratios.png)", ""]
    for name in results:
        lines.append(f"![{name} TTFT]({name}_ttft_cdf.png) ![{name}]({name}_ttft_vs_prompt.png)")
    return "\n".join(lines) + "\n"


def run_suite(
    out_dir: str | Path,
    scale: float = 1.0,
    server_args: str = "",
    server_cmd: str | None = None,
    workloads: list[str] | None = None,
    params: dict[str, str] | None = None,
    tokenizer: ChatTokenizer | None = None,
    command: str = "radixserve bench --suite",
    progress: bool = True,
    **plan_kw: Any,
) -> dict[str, CompareResult]:
    """Start `radixserve serve` twice (cache on, `--no-prefix-cache`) on free ports, run every
    workload against both alternately, and write report.md, results and plots into out_dir.
    `server_cmd` replaces `radixserve serve` (the port and `server_args` are appended)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(server_args)
    if not any(a.startswith("--kv-cache-memory") for a in extra):
        extra += ["--kv-cache-memory", SUITE_KV_MEMORY]  # two servers share the machine's RAM
    base = shlex.split(server_cmd) if server_cmd else radixserve_command()
    on = ServerProcess([*base, *extra], out)
    off = ServerProcess([*base, *extra, "--no-prefix-cache"], out)
    results: dict[str, CompareResult] = {}
    extras: dict[str, dict[str, Any]] = {}
    try:
        for s in (on, off):
            print(f"starting {shlex.join(s.argv)}", file=sys.stderr)
            s.start()
        urls = (check_loopback(on.url), check_loopback(off.url))

        async def go() -> None:
            async with make_client() as client:
                for u in urls:
                    await warmup(client, u, plan_kw.get("model"))
                for i, name in enumerate(workloads or list(SUITE_WORKLOADS)):
                    plan = suite_plan(name, scale, params, **plan_kw)
                    res = await compare(client, plan, urls, ("on", "off"), 1, progress, i)
                    results[name] = res
                    print(f"{name} ({res.load})\n{res.table()}\n", file=sys.stderr)

        asyncio.run(go())
    finally:
        on.stop()
        off.stop()
    for name, res in results.items():
        extras[name] = write_run_files(out, name, res, tokenizer)
    bars = [
        (
            n,
            r.summaries[1].ttft["p50"] / r.summaries[0].ttft["p50"],
            r.summaries[0].requests_per_s / max(r.summaries[1].requests_per_s, 1e-9),
        )
        for n, r in results.items()
    ]
    plot_suite_ratios(bars, out / "suite_ratios.png")
    shown = ["radixserve", "serve"] if server_cmd is None else base
    servers = [
        shlex.join([*shown, *s.argv[len(base) :]]).replace(str(s.port), "P") for s in (on, off)
    ]
    (out / "report.md").write_text(suite_markdown(results, extras, command, servers))
    summary = {
        n: {lab: s.to_json() for lab, s in zip(r.labels, r.summaries, strict=True)}
        for n, r in results.items()
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    return results
