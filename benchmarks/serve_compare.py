"""Side by side against other OpenAI-compatible servers: the cases a chat or agent user feels.

Run: python benchmarks/serve_compare.py --server radixserve "python -m radixserve.cli serve" \
        --server vllm "VLLM_CPU_KVCACHE_SPACE=2 .../python -m vllm.entrypoints.openai.api_server \
        --model DIR --served-model-name smollm2 --port {port} ..." [--trials 3]

Servers are started one at a time (each command may hold {port}; without it --port P is
appended) and driven with streaming /v1/completions at temperature 0 on real text (Python
stdlib docs, token counts from the default model's tokenizer). Per server and trial: cold TTFT
of a new 2,048-token and a new 4,096-token prompt, TTFT of the 2k prompt's exact repeat, TTFT
of it + 50 new tokens, decode tok/s of 1 stream, then 8 concurrent new 64-token prompts: their
TTFT p50 and decode tok/s (128 tokens each, ignore_eos); and each server's start to healthy,
peak RSS and RSS after the trials (its process group's, from /proc). `--cases` picks fewer
cases, `--warmup short` warms with one short request instead of a whole trial (both for models
whose cold prompts take minutes). With --rounds R the servers start R
times in turn (A, B, A, B: each round's prompts the same for every server, new to each),
--trials trials per start. Prints each server's load average (`uptime`) when its trials began
and ended, then medians and each case's ratio to the first server. `--tokenizer MODEL` counts
tokens with another model's tokenizer (a directory or .gguf, e.g. the Gemma 3 GGUF the servers
run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from radixserve.bench.cli import load_tokenizer
from radixserve.bench.client import fetch_model, make_client, send_request
from radixserve.bench.corpus import Corpus, TokenCounter
from radixserve.bench.servers import ServerProcess
from radixserve.bench.workloads import RequestSpec

DECODE_TOKENS = 128


async def _one(client, url: str, model: str, prompt: str, max_tokens: int, t0: float = 0.0):  # type: ignore[no-untyped-def]  # noqa: E501
    spec = RequestSpec("r", "s", 0, "completions", max_tokens, prompt=prompt)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    rec = await send_request(client, url, spec, body, t0 or time.perf_counter())
    if rec.error:
        raise RuntimeError(rec.error)
    return rec


def _decode_rate(recs) -> float:  # type: ignore[no-untyped-def]
    """Aggregate decode tokens/s: tokens after each first token over the common span."""
    first = min(r.start + r.ttft for r in recs)
    last = max(r.start + r.e2e for r in recs)
    return sum(max(0, (r.completion_tokens or 0) - 1) for r in recs) / (last - first)


CASES = ("cold2k", "repeat", "cached50", "cold4k", "decode1", "decode8")


async def trial(url: str, corpus: Corpus, cases: tuple[str, ...] = CASES) -> dict[str, float]:
    """One round of the `cases` against the server at `url` (the repeat and cached cases
    reuse cold2k's prompt, which they send first where cold2k is not among them)."""
    async with make_client() as client:
        model = await fetch_model(client, url)
        prompt = corpus.passage(2048)
        out: dict[str, float] = {}
        if "cold2k" in cases or "repeat" in cases or "cached50" in cases:
            cold = (await _one(client, url, model, prompt, 1)).ttft * 1e3
            if "cold2k" in cases:
                out["cold 2k TTFT (ms)"] = cold
        if "repeat" in cases:
            rec = await _one(client, url, model, prompt, 1)
            out["2k exact repeat TTFT (ms)"] = rec.ttft * 1e3
        if "cached50" in cases:
            more = prompt + " " + corpus.passage(50)
            rec = await _one(client, url, model, more, 1)
            out["2k cached + 50 new TTFT (ms)"] = rec.ttft * 1e3
        if "cold4k" in cases:
            long = corpus.passage(4096)
            out["cold 4k TTFT (ms)"] = (await _one(client, url, model, long, 1)).ttft * 1e3
        if "decode1" in cases:
            rec = await _one(client, url, model, corpus.passage(64), DECODE_TOKENS)
            out["decode 1 stream (tok/s)"] = _decode_rate([rec])
        if "decode8" in cases:
            t0 = time.perf_counter()  # one clock for the 8 streams' start times
            prompts = [corpus.passage(64) for _ in range(8)]
            recs = await asyncio.gather(
                *(_one(client, url, model, p, DECODE_TOKENS, t0) for p in prompts)
            )
            out["8 concurrent 64-token prompts TTFT p50 (ms)"] = (
                statistics.median(r.ttft for r in recs) * 1e3
            )
            out["decode 8 streams (tok/s)"] = _decode_rate(recs)
        return out


async def warm(url: str, corpus: Corpus) -> None:
    """A short request: the server's first-request costs, none of the cases' prompts."""
    async with make_client() as client:
        await _one(client, url, await fetch_model(client, url), corpus.passage(64), 8)


def load_average() -> str:
    """The 1-minute load average (other work on the machine skews every figure)."""
    return f"{os.getloadavg()[0]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", nargs=2, action="append", metavar=("LABEL", "COMMAND"))
    ap.add_argument("--trials", type=int, default=3, help="trials per server start")
    ap.add_argument("--rounds", type=int, default=1, help="times each server is started")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--tokenizer", default=None, help="model whose tokenizer counts tokens")
    ap.add_argument(
        "--cases", nargs="+", choices=CASES, default=list(CASES),
        help="the cases to run (fewer for large models: a cold 4k prompt takes minutes there)",
    )  # fmt: skip
    ap.add_argument(
        "--warmup", choices=("full", "short"), default="full",
        help="before the trials: a whole trial on other prompts, or one short request",
    )  # fmt: skip
    args = ap.parse_args()
    cases = tuple(args.cases)
    counter = TokenCounter(load_tokenizer(args.tokenizer))
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _ in args.server}
    for rnd in range(args.rounds):
        for label, command in args.server:
            t0 = time.perf_counter()
            server = ServerProcess(command).start(timeout=args.start_timeout)
            started = time.perf_counter() - t0
            print(f"{label}: healthy after {started:.1f} s", flush=True)
            try:
                # The same prompts for every server of a round; new ones every trial.
                corpus = Corpus(f"serve-compare:round{rnd}", counter)
                warmup = Corpus(f"serve-compare:warmup{rnd}", counter)
                if args.warmup == "full":
                    asyncio.run(trial(server.url, warmup, cases))
                else:
                    asyncio.run(warm(server.url, warmup))
                load_start = load_average()
                runs = [asyncio.run(trial(server.url, corpus, cases)) for _ in range(args.trials)]
                peak, now = server.memory()
                for run in runs:
                    run["start to healthy (s)"] = started
                    run["peak RSS (MB)"] = peak / 2**20
                    run["RSS after the trials (MB)"] = now / 2**20
                results[label] += runs
                print(f"{label}: load average {load_start} -> {load_average()}", flush=True)
            finally:
                server.stop()
    labels = list(results)
    base = labels[0]
    print(
        "\n| case | "
        + " | ".join(labels)
        + " | "
        + " | ".join(f"{x} / {base}" for x in labels[1:])
        + " |"
    )  # noqa: E501
    print("|---|" + "---|" * (2 * len(labels) - 1))
    for case in results[base][0]:
        med = {x: statistics.median(t[case] for t in results[x]) for x in labels}
        ratios = [f"{med[x] / med[base]:.2f}x" for x in labels[1:]]
        cells = " | ".join(f"{med[x]:.1f}" for x in labels)
        print(f"| {case} | {cells} | " + " | ".join(ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
