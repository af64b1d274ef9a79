"""Cold prefill and single-stream decode: radixserve vs transformers, same weights, one run.

Run: python benchmarks/model_bench.py [--lengths 512 2048 4096] [--dtypes float32 bfloat16]
Prints a Markdown table of seconds per cold prefill, decode tokens/s, the ratios, and the
matmul ceiling at the model's shapes so prefill efficiency reads as a fraction of it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from radixserve.model.batch import SeqChunk, build_batch
from radixserve.model.files import hf_export_dir, resolve_model
from radixserve.model.kv_pool import KVPool
from radixserve.model.loader import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best_of(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def prompt_ids(n: int) -> list[int]:
    return [(i * 7919) % 48000 + 100 for i in range(n)]


def ours_prefill(model, n: int, dtype: torch.dtype, reps: int) -> float:  # type: ignore[no-untyped-def]
    pool = KVPool(model.config, n // 16 + 2, 16, dtype)
    batch = build_batch([SeqChunk(prompt_ids(n), 0, list(range(n // 16 + 2)))], 16)
    return best_of(lambda: model(batch, pool), reps)


def ours_decode(model, ctx: int, steps: int, dtype: torch.dtype) -> float:  # type: ignore[no-untyped-def]
    blocks = (ctx + steps) // 16 + 2
    pool = KVPool(model.config, blocks, 16, dtype)
    table = list(range(blocks))
    model(build_batch([SeqChunk(prompt_ids(ctx), 0, table)], 16), pool)
    t = time.perf_counter()
    for s in range(steps):
        model(build_batch([SeqChunk([42], ctx + s, table)], 16), pool)
    return steps / (time.perf_counter() - t)


def hf_prefill(hf, n: int, reps: int) -> float:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt_ids(n)])

    def run() -> None:
        with torch.no_grad():
            hf(ids, logits_to_keep=1)

    return best_of(run, reps)


def hf_decode(hf, ctx: int, steps: int) -> float:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt_ids(ctx)])
    with torch.no_grad():
        out = hf(ids, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        tok = torch.tensor([[42]])
        t = time.perf_counter()
        for _ in range(steps):
            out = hf(tok, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
    return steps / (time.perf_counter() - t)


def matmul_ceiling(dtype: torch.dtype, m: int = 2048) -> float:
    """GFLOP/s of F.linear at the MLP shape [m, 576] x [1536, 576]^T."""
    x = torch.randn(m, 576, dtype=dtype)
    w = torch.randn(1536, 576, dtype=dtype)
    secs = best_of(lambda: F.linear(x, w), 10)
    return 2 * m * 576 * 1536 / secs / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--decode-ctx", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    from transformers import LlamaForCausalLM

    files = resolve_model(None)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| dtype | case | radixserve | transformers | speed-up |")
    print("|---|---|---|---|---|")
    for name in args.dtypes:
        dtype = DTYPES[name]
        ours = load_model(files, dtype, torch.device("cpu"))
        hf = LlamaForCausalLM.from_pretrained(str(hf_export_dir(files)), dtype=dtype).eval()
        for n in args.lengths:
            a = ours_prefill(ours, n, dtype, args.reps)
            b = hf_prefill(hf, n, args.reps)
            print(f"| {name} | cold prefill {n} tok (s) | {a:.3f} | {b:.3f} | {b / a:.2f}x |")
        a = statistics.median(
            ours_decode(ours, args.decode_ctx, args.decode_steps, dtype) for _ in range(2)
        )
        b = hf_decode(hf, args.decode_ctx, args.decode_steps)
        print(
            f"| {name} | decode after {args.decode_ctx} tok (tok/s) | {a:.1f} | {b:.1f} "
            f"| {a / b:.2f}x |"
        )
        del ours, hf
    for name in args.dtypes:
        print(
            f"\nmatmul ceiling {name} (F.linear, M=2048, 1536x576): "
            f"{matmul_ceiling(DTYPES[name]):.0f} GFLOP/s"
        )
    layers_flops = 2 * 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)
    print(f"non-attention GEMM work per token: {layers_flops / 1e6:.0f} MFLOP")


if __name__ == "__main__":
    main()
