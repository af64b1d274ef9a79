"""Quality of each arithmetic path and K/V dtype against float32: perplexity and next-token KL
divergence on real text, read through a server's own `/v1/completions` with `echo` + `logprobs`.

    python benchmarks/quality.py                     # the default model, every path this CPU runs
    python benchmarks/quality.py --model gemma3-270m --text FILE
    python benchmarks/quality.py --server vllm http://127.0.0.1:8000   # any OpenAI server too

The text (default: the GPL-3 licence Debian ships) is cut into `--windows` consecutive windows
of `--window` tokens by the model's tokenizer and sent as token ids, so every server scores the
same tokens. Each window's second half is scored (every scored token has at least half a
window of context). Perplexity is exp(-mean log-prob of the scored tokens). KL is
KL(reference || variant) per scored position over the reference's top `--top` tokens and the
rest of the vocabulary as one bucket (a coarser partition gives a lower bound of the full KL; a
token missing from the variant's top list takes the variant's last listed probability, an
upper bound of its own), averaged. `top-1 same` is the share of positions whose most likely
next token is the same as the reference's.

The reference is radixserve on float32 (`--dtype float32`: the file's weights dequantized
exactly, float32 arithmetic and K/V). The variants are each prefill path this CPU runs
(RADIXSERVE_PREFILL_PATH) with float32 K/V, then the default path with each 16-bit K/V dtype
(`--kv-cache-dtype`). llama.cpp's `llama-perplexity -f TEXT -c WINDOW` on the same GGUF is a
cross-check (its own windowing: it scores each window's second half too).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from radixserve.bench.cli import load_tokenizer
from radixserve.bench.client import fetch_model, make_client
from radixserve.bench.servers import ServerProcess, radixserve_command

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


@dataclass
class Scores:
    """Per scored position: the log-prob of the text's token, and the top log-probs."""

    logprobs: list[float]
    tops: list[dict[str, float]]

    @property
    def perplexity(self) -> float:
        return math.exp(-statistics.fmean(self.logprobs))


@dataclass
class Comparison:
    """A variant's scores against the reference's."""

    perplexity: float
    change: float  # relative to the reference's perplexity
    kl: float  # mean over scored positions
    top1_same: float  # share of positions


def windows(text: str, tokenizer_model: str | None, count: int, size: int) -> list[list[int]]:
    """The first `count` consecutive windows of `size` token ids of `text`."""
    ids = load_tokenizer(tokenizer_model).encode(text)
    if len(ids) < count * size:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {count} x {size}")
    return [ids[i * size : (i + 1) * size] for i in range(count)]


async def score(url: str, wins: list[list[int]], top: int, api_key: str | None = None) -> Scores:
    """Each window's second half scored by the server at `url`."""
    out = Scores([], [])
    async with make_client(api_key) as client:
        model = await fetch_model(client, url)
        for ids in wins:
            body = {
                "model": model,
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "echo": True,
                "logprobs": top,
            }
            r = await client.post(f"{url}/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
            lp = r.json()["choices"][0]["logprobs"]
            half = len(ids) // 2
            out.logprobs += [float(v) for v in lp["token_logprobs"][half : len(ids)]]
            out.tops += [dict(t or {}) for t in lp["top_logprobs"][half : len(ids)]]
    return out


def kl_top(ref: dict[str, float], var: dict[str, float]) -> float:
    """KL(ref || var) over ref's listed tokens and one bucket for the rest (module docstring)."""
    if not ref or not var:
        return 0.0
    floor = min(var.values())
    p = [math.exp(v) for v in ref.values()]
    q = [math.exp(var.get(t, floor)) for t in ref]
    p_rest, q_rest = max(1.0 - sum(p), 1e-12), max(1.0 - sum(q), 1e-12)
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)
    return max(kl + p_rest * math.log(p_rest / q_rest), 0.0)


def compare(ref: Scores, var: Scores) -> Comparison:
    """`var` against `ref` (the same windows)."""
    assert len(ref.logprobs) == len(var.logprobs)
    kls = [kl_top(a, b) for a, b in zip(ref.tops, var.tops, strict=True)]
    same = [
        max(a, key=a.__getitem__) == max(b, key=b.__getitem__)
        for a, b in zip(ref.tops, var.tops, strict=True)
        if a and b
    ]
    return Comparison(
        var.perplexity,
        var.perplexity / ref.perplexity - 1.0,
        statistics.fmean(kls),
        statistics.fmean(same) if same else float("nan"),
    )


def serve_and_score(
    command: list[str], env: dict[str, str], wins: list[list[int]], top: int
) -> Scores:
    """Start radixserve (or any server) with `env` added, score, stop it."""
    server = ServerProcess(command, env=env).start(timeout=600)
    try:
        return asyncio.run(score(server.url, wins, top))
    finally:
        server.stop()


def radixserve_variants(model: str | None) -> list[tuple[str, list[str], dict[str, str]]]:
    """(label, command, environment) of the reference then each variant (module docstring)."""
    from radixserve.model.kernels.matrix import available_paths, default_path

    base = ["--model", model] if model else []
    pin = {"RADIXSERVE_PREFILL_PATH": ""}
    out = [("float32 (reference)", radixserve_command(*base, "--dtype", "float32"), pin)]
    for path in available_paths():
        if path.value != "fp32":
            env = {"RADIXSERVE_PREFILL_PATH": path.value}
            cmd = radixserve_command(*base, "--kv-cache-dtype", "float32")
            out.append((f"{path.value}, K/V float32", cmd, env))
    default = default_path().value
    for kv in ("bfloat16", "float16"):
        cmd = radixserve_command(*base, "--kv-cache-dtype", kv)
        out.append((f"{default} (default), K/V {kv}", cmd, {"RADIXSERVE_PREFILL_PATH": default}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="radixserve --model (default: the default)")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--windows", type=int, default=14)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--top", type=int, default=20, help="top log-probs per position (<= 20)")
    ap.add_argument(
        "--server", nargs=2, action="append", default=[], metavar=("LABEL", "URL"),
        help="also score a running OpenAI-compatible server (same tokenizer)",
    )  # fmt: skip
    ap.add_argument("--only", nargs="*", default=None, help="variant labels to run (prefixes)")
    args = ap.parse_args()
    wins = windows(Path(args.text).read_text(), args.model, args.windows, args.window)
    print(f"{args.windows} windows of {args.window} tokens of {args.text}", flush=True)
    rows: list[tuple[str, Scores]] = []
    for label, command, env in radixserve_variants(args.model):
        if rows and args.only is not None and not any(label.startswith(o) for o in args.only):
            continue
        print(f"{label}: {shlex.join(command)} {env}", file=sys.stderr, flush=True)
        rows.append((label, serve_and_score(command, env, wins, args.top)))
    for label, url in args.server:
        rows.append((label, asyncio.run(score(url, wins, args.top))))
    ref = rows[0][1]
    print(f"\n| variant | perplexity | vs float32 | KL (top-{args.top} + rest) | top-1 same |")
    print("|---|---|---|---|---|")
    for label, scores in rows:
        c = compare(ref, scores)
        print(
            f"| {label} | {c.perplexity:.3f} | {100 * c.change:+.2f}% | {c.kl:.5f} "
            f"| {100 * c.top1_same:.1f}% |",
            flush=True,
        )


if __name__ == "__main__":
    try:
        main()
    except httpx.HTTPError as e:
        sys.exit(f"quality: {e}")
