"""The options of `radixserve bench` and `radixserve analyze`, each declared once
(radixserve.options)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixserve.bench.workloads import APIS, WORKLOADS, workload_name
from radixserve.engine.config import EngineConfig
from radixserve.options import default_of, option, types

_LOAD, _OUTPUT, _COMPARE = "load", "output", "comparison"


def _workload_sizes() -> str:
    lines = []
    for name, cls in WORKLOADS.items():
        sizes = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(cls))
        lines.append(f"{name} ({cls.summary}): {sizes}")
    return "; ".join(lines)


@dataclass(frozen=True)
class HashTraceOptions:
    """How a block-hash trace (Mooncake, Bailian) is read, for `analyze` and `bench --trace`."""

    trace_block_size: int | None = option(
        None,
        "tokens per hash id of a block-hash trace",
        type=types.positive_int,
        default_text="512 for Mooncake, 16 for Bailian",
    )


@dataclass(frozen=True)
class BenchConfig(HashTraceOptions):
    """A benchmark run: the workload, the load, where results go, and comparisons."""

    url: str = option("http://127.0.0.1:8000", "server base URL (loopback only)")
    workload: str = option(
        "rag",
        "the traffic shape (hyphens read as underscores: rag-extract)",
        type=workload_name,
        choices=tuple(WORKLOADS),
    )
    trace: str | None = option(
        None,
        "replay this Mooncake or Bailian block-hash trace instead of --workload: token ids "
        "synthesised per hash id from real text, sent at the trace's times (AIPerf's "
        "mooncake_trace); --max-requests takes its first N",
        metavar="FILE",
    )
    time_scale: float = option(
        1.0, "trace replay: multiply the trace's arrival times", type=types.positive_float
    )
    length_scale: float = option(
        1.0,
        "trace replay: multiply every block's tokens and every output length (at least 1)",
        type=types.positive_float,
    )
    param: list[str] = option(
        [],
        "workload size override, repeatable. Defaults: " + _workload_sizes(),
        repeat=True,
        metavar="KEY=VALUE",
    )
    seed: int = option(0, "selects the text (and Poisson times)", type=types.whole_number)
    api: str | None = option(None, "chat or completion", choices=APIS, default_text="per workload")
    model: str | None = option(None, "model name to request", default_text="the server's first")
    temperature: float = option(0.0, "sampling temperature of the requests", type=types.number)
    ignore_eos: bool = option(False, 'send "ignore_eos": true (vLLM/SGLang style)')
    api_key: str | None = option(None, "sent as a Bearer token")
    concurrency: int = option(4, "requests in flight", type=types.positive_int, group=_LOAD)
    rate: float | None = option(
        None,
        "Poisson arrivals at this many requests/s instead",
        type=types.positive_float,
        group=_LOAD,
    )
    max_requests: int | None = option(
        None, "stop after this many requests", type=types.positive_int, group=_LOAD
    )
    duration: float | None = option(
        None, "send no new request after this many seconds", type=types.positive_float, group=_LOAD
    )
    timeout: float = option(
        600.0, "per-request timeout (s)", type=types.positive_float, group=_LOAD
    )
    output_dir: str | None = option(None, "write results.json and PNG plots here", group=_OUTPUT)
    trace_out: str | None = option(
        None, "write the requests sent as a JSONL trace (for analyze)", group=_OUTPUT
    )
    progress: bool = option(True, "no progress bar", flag="--no-progress", group=_OUTPUT)
    dry_run: bool = option(
        False,
        "build the workload without a server (placeholder answers); use with --trace-out",
        group=_OUTPUT,
    )
    tokenizer: str | None = option(
        None,
        "tokenizer dir for measuring sizes ('none' = estimate 4 characters per token)",
        default_text="the default model's",
        group=_OUTPUT,
    )
    compare: list[str] | None = option(
        None,
        "run the workload against two servers alternately; each is a URL or a server command "
        "to start ('{port}' is replaced by a free port, else --port P is appended), split as a "
        'shell would: quote a JSON argument inside it ("radixserve serve --speculative-config '
        "'{...}'\")",
        nargs=2,
        metavar=("A", "B"),
        group=_COMPARE,
    )
    labels: list[str] = option(
        ["A", "B"],
        "labels of the two sides",
        nargs=2,
        metavar=("LABEL_A", "LABEL_B"),
        group=_COMPARE,
    )
    rounds: int = option(
        1, "alternations (each with seed+round)", type=types.positive_int, group=_COMPARE
    )
    slo_ttft: float | None = option(
        None,
        "with --compare: sweep Poisson rates (--sweep-start, doubling) on both sides until p90 "
        "TTFT exceeds this many seconds, and print the headline table (TTFT p50, maximum "
        "sustainable rate, cost per 1k tokens)",
        type=types.positive_float,
        group=_COMPARE,
    )
    sweep_start: float = option(
        0.25, "the rate sweep's first rate (req/s)", type=types.positive_float, group=_COMPARE
    )
    price_per_hour: float = option(
        1.0,
        "the machine's price in dollars per hour, for the cost per 1k tokens (prompt + "
        "completion) at the maximum sustainable rate",
        type=types.positive_float,
        group=_COMPARE,
    )
    suite: bool = option(
        False,
        "every workload, cache on vs off, against two `radixserve serve` it starts; writes "
        "report.md + plots into --output-dir (default bench-results)",
        group=_COMPARE,
    )
    scale: float = option(
        1.0, "suite: scale request counts", type=types.positive_float, group=_COMPARE
    )
    workloads: str | None = option(
        None, "suite: comma-separated subset of workloads", default_text="all", group=_COMPARE
    )
    server_args: str = option(
        "",
        "suite: extra `radixserve serve` arguments, quoted (the suite adds --kv-cache-memory "
        "1GiB unless given)",
        group=_COMPARE,
    )
    server_cmd: str | None = option(
        None,
        "suite: the server command instead of `radixserve serve`, quoted",
        group=_COMPARE,
    )


@dataclass(frozen=True)
class AnalyzeConfig(HashTraceOptions):
    """What `analyze` replays a trace with: tokenizer, block size, KV shape, capacities (a
    block-hash trace is never tokenized: its blocks are `--trace-block-size` tokens)."""

    model: str | None = option(
        None, "model whose tokenizer and KV shape to use", default_text="the default model"
    )
    tokenizer: str | None = option(
        None, "tokenizer directory, if not the model's", default_text="the model's"
    )
    block_size: int = option(
        default_of(EngineConfig, "block_size"), "cache block size in tokens", type=types.block_size
    )
    kv_dtype: str = option(
        "bfloat16", "K/V element type", choices=("float32", "bfloat16", "float16", "fp8")
    )
    capacities: str | None = option(
        None, "cache sizes to replay, comma-separated: blocks (1024) or bytes (256MiB, 2GiB)"
    )
    policy: str | None = option(
        None,
        "eviction policies to replay and compare, comma-separated (e.g. lru,fanout,slru); adds "
        "a table and policy_curves.png",
    )
    strict: bool = option(False, "stop at the first malformed line of a block-hash trace")
    output_dir: str | None = option(None, "write analysis.json and PNG plots here")
