"""`radixserve analyze TRACE`: arguments and entry point, for OpenAI-body traces (tokenized
with the model's tokenizer) and block-hash traces (Mooncake, Bailian: never tokenized)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from radixserve.bench.analyze import Analysis, analyze_tokens, kv_bytes_per_token, read_trace
from radixserve.bench.analyze import tokenize as tokenize_trace
from radixserve.bench.analyze_report import format_analysis
from radixserve.bench.config import AnalyzeConfig
from radixserve.bench.hash_trace import (
    FORMATS,
    TraceLineError,
    analyze_hash_trace,
    detect_format,
    read_hash_trace,
)
from radixserve.cache import POLICIES
from radixserve.engine.tokenizer import Tokenizer
from radixserve.errors import RadixServeError
from radixserve.model.config import ModelConfig
from radixserve.model.files import resolve_model
from radixserve.options import add_options

MAX_PROBLEMS_SHOWN = 10


def add_analyze_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `radixserve analyze` (radixserve.bench.config.AnalyzeConfig)."""
    parser.add_argument(
        "trace",
        help="JSONL trace: OpenAI request bodies (docs/bench.md), or a Mooncake or Bailian "
        "block-hash trace (told apart by the first line)",
    )
    add_options(parser, AnalyzeConfig, "analyze")


def parse_capacity(text: str, bytes_per_block: int) -> int:
    """'1024' -> 1024 blocks; '256MiB' / '2GiB' / '500MB' -> blocks of that many bytes."""
    t = text.strip()
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    for unit, mult in units.items():
        if t.endswith(unit):
            return max(1, int(float(t[: -len(unit)]) * mult) // bytes_per_block)
    return int(t)


def run_analyze(args: argparse.Namespace) -> int:
    """Entry point of `radixserve analyze`."""
    started = time.perf_counter()
    try:
        policies = [n.strip() for n in (args.policy or "").split(",") if n.strip()]
        for name in policies:
            if name not in POLICIES:
                raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        model_dir = resolve_model(args.model, weights=False).path
        kv = kv_bytes_per_token(ModelConfig.from_dir(model_dir), args.kv_dtype)
        fmt = detect_format(args.trace)
        if fmt == "openai":
            tok = Tokenizer.from_dir(args.tokenizer or str(model_dir))
            a = _analyze_bodies(args, tok, kv, policies)
        else:
            a = _analyze_hashes(args, fmt, kv, policies)
    except (OSError, ValueError, RadixServeError) as e:
        print(f"radixserve analyze: error: {e}", file=sys.stderr)
        return 2
    print(format_analysis(a))
    print(f"\nanalyzed in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.output_dir:
        _write_outputs(a, Path(args.output_dir), Path(args.trace).stem)
    return 0


def _capacities(args: argparse.Namespace, bytes_per_block: int) -> list[int] | None:
    if not args.capacities:
        return None
    return [parse_capacity(c, bytes_per_block) for c in args.capacities.split(",") if c.strip()]


def _analyze_bodies(
    args: argparse.Namespace, tok: Tokenizer, kv: int, policies: list[str]
) -> Analysis:
    requests = read_trace(args.trace)
    skipped: list[str] = []
    seqs = tokenize_trace(requests, tok, skipped)
    if skipped:
        print(f"skipped {len(skipped)} request(s), e.g. {skipped[0]}", file=sys.stderr)
    if not seqs:
        raise ValueError(f"{args.trace} holds no usable request")
    caps = _capacities(args, kv * args.block_size)
    return analyze_tokens(seqs, args.block_size, kv, args.kv_dtype, caps, policies)


def _analyze_hashes(args: argparse.Namespace, fmt: str, kv: int, policies: list[str]) -> Analysis:
    block_size = args.trace_block_size or FORMATS[fmt]
    problems: list[str] = []
    try:
        reqs = read_hash_trace(args.trace, fmt, block_size, args.strict, problems)
    except TraceLineError as e:
        raise ValueError(f"{args.trace}: {e} (--strict)") from None
    for line in problems[:MAX_PROBLEMS_SHOWN]:
        print(f"radixserve analyze: skipped {line}", file=sys.stderr)
    if len(problems) > MAX_PROBLEMS_SHOWN:
        print(
            f"radixserve analyze: skipped {len(problems) - MAX_PROBLEMS_SHOWN} more malformed "
            "line(s)",
            file=sys.stderr,
        )
    if not reqs:
        raise ValueError(f"{args.trace} holds no usable request")
    print(
        f"{fmt} trace: {len(reqs)} requests, {block_size}-token blocks"
        + (f", {len(problems)} malformed line(s) skipped" if problems else ""),
        file=sys.stderr,
    )
    caps = _capacities(args, kv * block_size)
    return analyze_hash_trace(reqs, block_size, fmt, kv, args.kv_dtype, caps, policies)


def _write_outputs(a: Analysis, out: Path, title: str) -> None:
    from radixserve.bench.plots import (
        plot_miss_ratio_curve,
        plot_policy_curves,
        plot_shared_prefix_hist,
    )

    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(a.to_json(), indent=1))
    plot_shared_prefix_hist(a, out / "shared_prefix_hist.png")
    plot_miss_ratio_curve(a, out / "miss_ratio_curve.png")
    if a.policy_curves:
        plot_policy_curves(a, out / "policy_curves.png", f"{title}: hit ratio")
