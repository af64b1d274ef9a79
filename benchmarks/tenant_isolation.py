"""Does a tenant's TTFT reveal whether another tenant sent the same prompt? (`cache_salt`)

Per trial, with fresh prompts of equal length, interleaved:
  salted_seen     tenant A (cache_salt "tenant-a") sends P; tenant B (salt "tenant-b") then
                  sends P: measured. Isolation means this looks like `salted_unseen`.
  salted_unseen   tenant B sends a prompt nobody sent before: measured.
  unsalted_seen   control: A then B send P without salt; B hits A's cache. Shows that the
                  measurement does detect sharing when there is some.
TTFT is the time to the first streamed token, with max_tokens=1; usage.cached_tokens is
recorded too.

    python benchmarks/tenant_isolation.py --trials 12 --prompt-tokens 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import httpx

from radixserve.bench.corpus import Corpus
from radixserve.bench.report import percentile
from radixserve.bench.servers import ServerProcess, radixserve_command

DEFAULT_SERVE = "--kv-cache-memory 256MiB --max-model-len 2048"
CASES = ("salted_seen", "salted_unseen", "unsalted_seen")


def ttft(client: httpx.Client, url: str, prompt: str, salt: str | None) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens) of one request."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if salt is not None:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    first, cached = None, -1
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None, "no token streamed"
    return first, cached


def measure(url: str, trials: int, prompt_tokens: int, seed: int) -> dict[str, Any]:
    """TTFT samples (ms) and cached-token counts of each case."""
    corpus = Corpus(f"tenant-isolation:{seed}")
    out: dict[str, dict[str, list[float]]] = {c: {"ttft_ms": [], "cached": []} for c in CASES}
    with httpx.Client(timeout=600, trust_env=False) as client:
        ttft(client, url, corpus.passage(prompt_tokens), None)  # warm the server up
        for _ in range(trials):
            for case in CASES:
                prompt = corpus.passage(prompt_tokens)
                if case == "salted_seen":
                    ttft(client, url, prompt, "tenant-a")
                    t, cached = ttft(client, url, prompt, "tenant-b")
                elif case == "salted_unseen":
                    t, cached = ttft(client, url, prompt, "tenant-b")
                else:
                    ttft(client, url, prompt, None)
                    t, cached = ttft(client, url, prompt, None)
                out[case]["ttft_ms"].append(t * 1000)
                out[case]["cached"].append(cached)
    return out


def summarize(samples: dict[str, Any]) -> dict[str, Any]:
    """p10/p50/p90/mean TTFT and mean cached tokens per case."""
    table = {}
    for case, s in samples.items():
        xs = sorted(s["ttft_ms"])
        table[case] = {
            "n": len(xs),
            "p10_ms": percentile(xs, 10),
            "p50_ms": percentile(xs, 50),
            "p90_ms": percentile(xs, 90),
            "mean_ms": statistics.fmean(xs),
            "mean_cached_tokens": statistics.fmean(s["cached"]),
        }
    return table


def main(argv: list[str] | None = None) -> int:
    """Start a server unless --url is given, measure, print a markdown table and JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url")
    p.add_argument("--serve-args", default=DEFAULT_SERVE)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write samples and summary here")
    args = p.parse_args(argv)
    if args.url:
        samples = measure(args.url.rstrip("/"), args.trials, args.prompt_tokens, args.seed)
    else:
        with ServerProcess(radixserve_command(*args.serve_args.split())) as server:
            samples = measure(server.url, args.trials, args.prompt_tokens, args.seed)
    table = summarize(samples)
    print("| case | n | TTFT p10 ms | p50 ms | p90 ms | mean ms | cached tokens (mean) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, r in table.items():
        print(
            f"| {case} | {r['n']} | {r['p10_ms']:.0f} | {r['p50_ms']:.0f} | {r['p90_ms']:.0f} "
            f"| {r['mean_ms']:.0f} | {r['mean_cached_tokens']:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "summary": table, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
