"""Eviction on the two sides of prefill/decode disaggregation, under memory pressure.

Run: python benchmarks/pd_eviction.py [--rounds 2] [--configs fanout/lru:96MiB/96MiB ...]
Per config PREFILL_POLICY/DECODE_POLICY[:PREFILL_POOL/DECODE_POOL] (pools default to
--pool): a prefill worker and a decode worker (one thread each, `--kv-cache-memory` and
`--eviction-policy` as named) behind `route
--pd-disaggregation`, driven with `radixserve bench --workload pd_burst` (4 chats of 3 turns
answering 96 tokens behind a shared system prompt, 6 one-off 2k-token documents among them,
concurrency 5). Prints per config: the prompt tokens the prefill worker computed (what its
cache did not give), the tokens whose K/V moved to the decode worker, the blocks each side
evicted, and the streams' TTFT and TPOT p99 and the documents' TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys

import httpx

from radixserve.bench.client import make_client
from radixserve.bench.load import BenchPlan, LoadConfig
from radixserve.bench.pd_burst import burst_stats
from radixserve.bench.report import RequestRecord, percentile
from radixserve.bench.servers import ServerProcess, radixserve_command
from radixserve.bench.suite import warmup
from radixserve.bench.workloads import PrefillBurst


def counter(url: str, name: str) -> float:
    """A counter's value, summed over its labels, from `url`'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$"
    return sum(float(v) for v in re.findall(pattern, text, flags=re.M))


async def drive(
    url: str, prefill: str, decode: str, rounds: int
) -> tuple[list[RequestRecord], list[float]]:
    """pd_burst's rounds through the router at `url`; the records, and how much each of the
    counters in _PREFILL (prefill worker) and _DECODE (decode worker) grew meanwhile."""
    plan = BenchPlan(PrefillBurst(), LoadConfig(concurrency=5), extra_body={"ignore_eos": True})

    def counters() -> list[float]:
        return [counter(prefill, n) for n in _PREFILL] + [counter(decode, n) for n in _DECODE]

    async with make_client() as client:
        await warmup(client, url, None)
        before = counters()
        records: list[RequestRecord] = []
        for r in range(rounds):
            records += (await plan.run(client, url, r, progress=False)).records
        after = counters()
    return records, [b - a for a, b in zip(before, after, strict=True)]


def run_config(config: str, pool: str, rounds: int) -> str:
    """One config's row of the table."""
    policies, _, pools = config.partition(":")
    prefill_policy, _, decode_policy = policies.partition("/")
    prefill_pool, _, decode_pool = (pools or f"{pool}/{pool}").partition("/")
    common = ["--max-model-len", "3072", "--num-threads", "1", "--log-level", "warning"]
    p = ServerProcess(radixserve_command(
        *common, "--disaggregation-mode", "prefill", "--eviction-policy", prefill_policy,
        "--kv-cache-memory", prefill_pool,
    ))  # fmt: skip
    d = ServerProcess(radixserve_command(
        *common, "--disaggregation-mode", "decode", "--eviction-policy", decode_policy,
        "--kv-cache-memory", decode_pool,
    ))  # fmt: skip
    with p, d:
        route = ["--pd-disaggregation", "--prefill", p.url, "--decode", d.url]
        argv = [sys.executable, "-m", "radixserve.cli", "route", *route, "--log-level", "warning"]
        with ServerProcess(argv) as router:
            records, moved = asyncio.run(drive(router.url, p.url, d.url, rounds))
    queries, hits, p_evicted, tokens_moved, d_evicted = moved
    s = burst_stats(records)
    errors = sum(not r.ok for r in records)
    later = [r.ttft * 1000 for r in records if r.ok and r.session_id.startswith("stream-")
             and r.turn > 0 and r.ttft is not None]  # fmt: skip
    return (
        f"| {prefill_policy} / {decode_policy}, {prefill_pool} / {decode_pool} | "
        f"{queries - hits:,.0f} of {queries:,.0f} | "
        f"{tokens_moved:,.0f} | {p_evicted:,.0f} / {d_evicted:,.0f} | "
        f"{percentile(later, 50):,.0f} | "
        f"{s.tpot_p99_ms:.1f} | {s.burst_ttft_p50_ms:,.0f} | {errors} |"
    )


_PREFILL = (
    "radixserve_prefix_cache_queries_total",
    "radixserve_prefix_cache_hits_total",
    "radixserve_evicted_blocks_total",
)
_DECODE = ("radixserve_kv_transfer_tokens_total", "radixserve_evicted_blocks_total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", default="96MiB", help="--kv-cache-memory of a worker")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--configs", nargs="+", default=["lru/lru", "fanout/lru", "fanout/fanout"],
        help="PREFILL_POLICY/DECODE_POLICY[:PREFILL_POOL/DECODE_POOL]",
    )  # fmt: skip
    args = parser.parse_args()
    print(
        "| prefill / decode: policy, pool | prompt tokens the prefill worker computed | tokens "
        "moved | blocks evicted (prefill / decode) | later turns' TTFT p50 (ms) | streams' TPOT "
        "p99 (ms) | documents' TTFT p50 (ms) | errors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        print(run_config(config, args.pool, args.rounds), flush=True)


if __name__ == "__main__":
    main()
