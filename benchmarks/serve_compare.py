"""Side by side against other OpenAI-compatible servers: the cases a chat or agent user feels.

Run: python benchmarks/serve_compare.py --server radixserve "python -m radixserve.cli serve" \
        --server vllm "VLLM_CPU_KVCACHE_SPACE=2 .../python -m vllm.entrypoints.openai.api_server \
        --model DIR --served-model-name smollm2 --port {port} ..." [--trials 3]

Servers are started one at a time (each command may hold {port}; without it --port P is
appended) and driven with streaming /v1/completions at temperature 0 on real text (Python
stdlib docs, token counts from the default model's tokenizer). Per server and trial: cold TTFT
of a new 2,048-token prompt, TTFT of its exact repeat, TTFT of it + 50 new tokens, decode tok/s
of 1 stream and of 8 concurrent streams (128 tokens each, ignore_eos). Prints medians and each
case's ratio to the first server. `--tokenizer MODEL` counts tokens with another model's
tokenizer (a directory or .gguf, e.g. the Gemma 3 GGUF the servers run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
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


async def trial(url: str, corpus: Corpus) -> dict[str, float]:
    """One round of every case against the server at `url`."""
    async with make_client() as client:
        model = await fetch_model(client, url)
        prompt = corpus.passage(2048)
        out: dict[str, float] = {}
        out["cold 2k TTFT (ms)"] = (await _one(client, url, model, prompt, 1)).ttft * 1e3
        out["2k exact repeat TTFT (ms)"] = (await _one(client, url, model, prompt, 1)).ttft * 1e3
        more = prompt + " " + corpus.passage(50)
        out["2k cached + 50 new TTFT (ms)"] = (await _one(client, url, model, more, 1)).ttft * 1e3
        rec = await _one(client, url, model, corpus.passage(64), DECODE_TOKENS)
        out["decode 1 stream (tok/s)"] = _decode_rate([rec])
        t0 = time.perf_counter()  # one clock for the 8 streams' start times
        prompts = [corpus.passage(64) for _ in range(8)]
        recs = await asyncio.gather(
            *(_one(client, url, model, p, DECODE_TOKENS, t0) for p in prompts)
        )
        out["decode 8 streams (tok/s)"] = _decode_rate(recs)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", nargs=2, action="append", metavar=("LABEL", "COMMAND"))
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--tokenizer", default=None, help="model whose tokenizer counts tokens")
    args = ap.parse_args()
    counter = TokenCounter(load_tokenizer(args.tokenizer))
    results: dict[str, list[dict[str, float]]] = {}
    for label, command in args.server:
        env_prefix = []
        argv = shlex.split(command)
        while argv and "=" in argv[0] and not argv[0].startswith("-"):
            env_prefix.append(argv.pop(0))
        for item in env_prefix:
            key, _, value = item.partition("=")
            os.environ[key] = value
        t0 = time.perf_counter()
        server = ServerProcess(argv).start(timeout=args.start_timeout)
        print(f"{label}: healthy after {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            corpus = Corpus(f"serve-compare:{label}", counter)
            asyncio.run(trial(server.url, Corpus("serve-compare:warmup", counter)))
            results[label] = [asyncio.run(trial(server.url, corpus)) for _ in range(args.trials)]
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
