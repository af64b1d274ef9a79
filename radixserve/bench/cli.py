"""`radixserve bench` and `radixserve analyze`: arguments and entry points."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from radixserve.bench.client import NotLoopbackError, check_loopback, make_client
from radixserve.bench.config import BenchConfig
from radixserve.bench.corpus import TokenCounter
from radixserve.bench.hash_trace import FORMATS, detect_format, read_hash_trace
from radixserve.bench.headline import headline_table, sweep_plan
from radixserve.bench.load import BenchPlan, LoadConfig, RunPlan, RunResult
from radixserve.bench.pd_burst import burst_stats, format_bursts
from radixserve.bench.report import Summary, format_summary, same_answers, summarize
from radixserve.bench.spike import format_phases, phase_stats, to_json
from radixserve.bench.tools import agent_stats, format_agent
from radixserve.bench.trace_replay import Scaling, TracePlan, TraceWorkload
from radixserve.bench.workloads import (
    AgentLoop,
    PrefillBurst,
    Spike,
    build_sessions,
    make_workload,
    script,
    workload_name,
)
from radixserve.engine.tokenizer import Tokenizer
from radixserve.errors import RadixServeError
from radixserve.model.files import resolve_model
from radixserve.options import add_options


def load_tokenizer(model: str | None, tokenizer_dir: str | None = None) -> Tokenizer:
    """The model's tokenizer (or the one in `tokenizer_dir`); no weights are loaded."""
    if tokenizer_dir:
        return Tokenizer.from_dir(tokenizer_dir)
    return Tokenizer.from_dir(resolve_model(model, weights=False).path)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `radixserve bench` (radixserve.bench.config.BenchConfig)."""
    add_options(parser, BenchConfig, "bench")


def _params(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--param wants KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _counter(args: argparse.Namespace) -> TokenCounter:
    if args.tokenizer == "none":
        return TokenCounter(None)
    return TokenCounter(load_tokenizer(None, args.tokenizer))


def _write_trace(path: str, trace: list[dict[str, Any]]) -> None:
    Path(path).write_text("".join(json.dumps(e) + "\n" for e in trace))


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of `radixserve bench`."""
    try:
        return _run_bench(args)
    except (NotLoopbackError, ValueError, RuntimeError, OSError, RadixServeError) as e:
        print(f"radixserve bench: error: {e}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace, counter: TokenCounter) -> BenchPlan:
    load = LoadConfig(args.concurrency, args.rate, args.max_requests, args.duration, args.seed)
    return BenchPlan(
        make_workload(args.workload, _params(args.param)),
        load,
        args.seed,
        args.api,
        args.model,
        args.temperature,
        {"ignore_eos": True} if args.ignore_eos else {},
        counter,
    )


def _run_bench(args: argparse.Namespace) -> int:
    counter = _counter(args)
    if args.suite:
        return _run_suite(args, counter)
    plan = _run_plan(args, counter)
    if isinstance(plan, BenchPlan) and args.dry_run:
        return _dry_run(args, plan, counter)
    if args.compare:
        return _run_compare(args, plan, args.progress)
    return _run_one(args, plan)


def _run_suite(args: argparse.Namespace, counter: TokenCounter) -> int:
    """`--suite`: every workload against each server command; prints the suite's report."""
    from radixserve.bench.suite import run_suite

    out = args.output_dir or "bench-results"
    names = [workload_name(n) for n in args.workloads.split(",")] if args.workloads else None
    for n in names or []:
        make_workload(n)  # validates the name
    run_suite(
        out,
        args.scale,
        args.server_args,
        args.server_cmd,
        names,
        _params(args.param),
        counter.codec,  # type: ignore[arg-type]
        "radixserve " + shlex.join(sys.argv[1:]),
        args.progress,
        seed=args.seed,
        model=args.model,
        temperature=args.temperature,
        counter=counter,
    )
    print(Path(out, "report.md").read_text())
    return 0


def _run_plan(args: argparse.Namespace, counter: TokenCounter) -> BenchPlan | TracePlan:
    """The replay of `--trace`, or else the `--workload`; rejects flags the plan cannot use."""
    plan: BenchPlan | TracePlan
    if args.trace:
        if args.dry_run:
            raise ValueError("--dry-run builds a --workload; a --trace needs a server")
        plan = _trace_plan(args, counter)
    else:
        plan = _plan(args, counter)
    if args.slo_ttft and not (args.compare and isinstance(plan, BenchPlan)):
        raise ValueError("--slo-ttft sweeps rates of a --workload under --compare A B")
    return plan


def _dry_run(args: argparse.Namespace, plan: BenchPlan, counter: TokenCounter) -> int:
    """`--dry-run`: build the workload's requests without a server; print their count and
    write them to --trace-out."""
    sessions = build_sessions(plan.workload, args.seed, counter)
    specs = script(sessions, plan.api_name)
    trace = [
        {"id": s.id, "session_id": s.session_id, "turn": s.turn, "timestamp": float(i)}
        | {k: v for k, v in s.body(args.model or "default").items() if "stream" not in k}
        for i, s in enumerate(specs)
    ]
    if args.trace_out:
        _write_trace(args.trace_out, trace)
    print(
        f"{plan.workload.name}: {len(specs)} requests ({plan.api_name}), sizes "
        f"{'measured' if counter.exact else 'estimated'}: {plan.workload.params()}"
    )
    return 0


def _run_one(args: argparse.Namespace, plan: BenchPlan | TracePlan) -> int:
    """Drive `plan` against --url and report it; 1 if every request failed."""
    url = check_loopback(args.url)
    res, cache_stats = asyncio.run(_drive(args, plan, url))
    summary = summarize(res.records, res.duration)
    title = f"{plan.workload.name} against {url} ({plan.load.describe()})"
    print(format_summary(summary, title))
    _trace_report(plan, [summary])
    spike = _spike_report(plan, res.records, cache_stats)
    agent = _agent_report(plan, res.records)
    _burst_report(plan, [res.records], ["server"])
    if args.trace_out:
        _write_trace(args.trace_out, res.trace)
    if args.output_dir:
        _write_results(
            Path(args.output_dir), url, plan, res, summary, cache_stats, spike=spike, agent=agent
        )
    return 1 if summary.errors == summary.requests else 0


async def _drive(
    args: argparse.Namespace, plan: RunPlan, url: str
) -> tuple[RunResult, list[dict[str, Any]]]:
    """Run `plan` against `url`; with the server's cache stats before and after the run."""
    async with make_client(args.api_key, args.timeout) as client:
        before = await _cache_stats(client, url)
        res = await plan.run(client, url, progress=args.progress)
        after = await _cache_stats(client, url)
    return res, [before, after]


def _write_results(
    out: Path,
    url: str,
    plan: BenchPlan | TracePlan,
    res: RunResult,
    summary: Summary,
    cache_stats: list[dict[str, Any]],
    *,
    spike: dict[str, object] | None,
    agent: dict[str, Any] | None,
) -> None:
    """Write one run's results.json (with the spike and agent reports it has) and its
    TTFT plots under `out`."""
    from radixserve.bench.plots import plot_ttft_cdf, plot_ttft_vs_prompt

    out.mkdir(parents=True, exist_ok=True)
    data = {
        "url": url,
        "workload": plan.workload.name,
        "params": plan.workload.params(),
        "load": dataclasses.asdict(plan.load),
        "summary": summary.to_json(),
        "records": [dataclasses.asdict(r) for r in res.records],
        "cache_stats": cache_stats,
    }
    if spike is not None:
        data["spike"] = spike
    if agent is not None:
        data["agent"] = agent
    (out / "results.json").write_text(json.dumps(data, indent=1))
    plot_ttft_cdf({plan.workload.name: res.records}, out / "ttft_cdf.png")
    plot_ttft_vs_prompt({plan.workload.name: res.records}, out / "ttft_vs_prompt.png")


async def _cache_stats(client: Any, url: str) -> dict[str, Any]:
    """The server's /v1/cache/stats, or {} if it has none (another server)."""
    try:
        r = await client.get(f"{url}/v1/cache/stats")
        return dict(r.json()) if r.status_code == 200 else {}
    except Exception:  # a peer server without the route, or a non-JSON answer
        return {}


def _spike_report(
    plan: RunPlan, records: list[Any], cache_stats: list[dict[str, Any]]
) -> dict[str, object] | None:
    """Print and return the spike workload's per-phase report (None for other workloads)."""
    if not isinstance(plan.workload, Spike):
        return None
    before, after = cache_stats
    block_size = int(after.get("block_size", 16))

    def moved(name: str) -> int:
        return int(after.get(name, 0)) - int(before.get(name, 0))

    stats = phase_stats(records, plan.workload.hot_prefix_tokens, block_size)
    policy = after.get("eviction_policy", "?")
    print(f"\nspike, eviction policy {policy} (pool {after.get('total_blocks', '?')} blocks):")
    print(format_phases(stats, moved("refetch_blocks"), moved("evicted_blocks")))
    out = to_json(stats, moved("refetch_blocks"), moved("evicted_blocks"))
    out["eviction_policy"] = policy
    return out


def _burst_report(plan: RunPlan, records: list[list[Any]], labels: list[str]) -> None:
    """Print the pd_burst workload's streams-and-documents table (nothing for others)."""
    if not isinstance(plan.workload, PrefillBurst):
        return
    stats = [burst_stats(r, label) for r, label in zip(records, labels, strict=True)]
    print("\npd_burst: the streams' decode while documents are prefilled")
    print(format_bursts(stats))


def _agent_report(plan: RunPlan, records: list[Any], label: str = "") -> dict[str, Any] | None:
    """Print and return the agent workload's constrained-vs-free report (None for others)."""
    if not isinstance(plan, BenchPlan) or not isinstance(plan.workload, AgentLoop):
        return None
    if plan.api_name != "chat":
        return None
    stats = agent_stats(records)
    print("\n" + format_agent(stats, f"agent{f' [{label}]' if label else ''}"))
    return stats


def _trace_plan(args: argparse.Namespace, counter: TokenCounter) -> TracePlan:
    """The replay of `--trace`, scaled by --time-scale, --length-scale, --max-requests."""
    fmt = detect_format(args.trace)
    if fmt == "openai":
        raise ValueError(f"{args.trace} is not a Mooncake or Bailian block-hash trace")
    if counter.codec is None:
        raise ValueError("a trace replay synthesises token ids: it needs a --tokenizer")
    block_size = args.trace_block_size or FORMATS[fmt]
    problems: list[str] = []
    reqs = read_hash_trace(args.trace, fmt, block_size, problems=problems)
    for line in problems[:10]:
        print(f"radixserve bench: skipped {line}", file=sys.stderr)
    if not reqs:
        raise ValueError(f"{args.trace} holds no usable request")
    scaling = Scaling(args.time_scale, args.length_scale, args.max_requests)
    return TracePlan(
        reqs, block_size, scaling, counter.codec, args.seed, args.model, args.temperature,
        TraceWorkload(f"{fmt} trace"),
    )  # fmt: skip


def _trace_report(plan: RunPlan, summaries: list[Summary], labels: list[str] | None = None) -> None:
    """After a trace replay: each server's cached share of prompt tokens against the trace's."""
    if not isinstance(plan, TracePlan):
        return
    names = labels or ["server"]
    cached = ", ".join(
        f"{name} {s.cache_hit_ratio:.1%}" for name, s in zip(names, summaries, strict=True)
    )
    print(
        f"cached prompt tokens (the servers' usage): {cached}; the trace's own reusable share: "
        f"{plan.reusable_share:.1%} (unbounded cache, its hash ids)"
    )
    if plan.truncated:
        print(f"{plan.truncated} prompt(s) cut to fit the server's context")


def _run_compare(args: argparse.Namespace, plan: RunPlan, progress: bool) -> int:
    from radixserve.bench.servers import ServerProcess
    from radixserve.bench.suite import compare, warmup, write_run_files

    servers = []
    urls = []
    try:
        for target in args.compare:
            if target.startswith(("http://", "https://")):
                urls.append(check_loopback(target))
            else:
                s = ServerProcess(target, args.output_dir)
                servers.append(s)
                print(f"starting {shlex.join(s.argv)}", file=sys.stderr)
                urls.append(check_loopback(s.start().url))

        async def go() -> Any:
            async with make_client(args.api_key, args.timeout) as client:
                for u in urls:
                    await warmup(client, u, args.model)
                labels = (args.labels[0], args.labels[1])
                res = await compare(client, plan, (urls[0], urls[1]), labels, args.rounds, progress)
                sweeps = None
                if args.slo_ttft and isinstance(plan, BenchPlan):
                    sweeps = await sweep_plan(
                        client, plan, (urls[0], urls[1]), args.slo_ttft, args.sweep_start,
                        args.max_requests, progress,
                    )  # fmt: skip
                return res, sweeps

        res, sweeps = asyncio.run(go())
    finally:
        for s in servers:
            s.stop()
    print(f"{plan.workload.name} ({plan.load.describe()}, {args.rounds} round(s))")
    print(res.table())
    same, paired = same_answers(res.records[0], res.records[1])
    print(f"identical answers {res.labels[0]} vs {res.labels[1]}: {same} of {paired} requests")
    for label, records in zip(res.labels, res.records, strict=True):
        _agent_report(plan, records, label)
    _burst_report(plan, list(res.records), list(res.labels))
    if sweeps is not None:
        for label, sw in zip(res.labels, sweeps, strict=True):
            steps = ", ".join(f"{p.rate:g}: {p.ttft_p90 * 1000:.0f} ms" for p in sw.points)
            print(f"rate sweep {label} (req/s: p90 TTFT): {steps}")
        ttft = (res.summaries[0].ttft["p50"], res.summaries[1].ttft["p50"])
        print(
            headline_table(
                res.labels, ttft, sweeps, args.slo_ttft, args.price_per_hour, args.sweep_start
            )
        )
    _trace_report(plan, list(res.summaries), list(res.labels))
    if args.trace_out:
        _write_trace(args.trace_out, res.trace)
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        write_run_files(Path(args.output_dir), plan.workload.name, res, None)
    return 0
