"""Milliseconds per call of the K-quant panel kernels at a Q4_K_M 1B's shapes, one run.

Run: RADIXSERVE_CPU_ISA=avx2 python benchmarks/kquant_panels_bench.py [--rows 1 8 64 512]

What the figures of docs/cpu.md's `int8-avx2` row came from (the Zen 3's kernels, built as an
AVX2-only CPU builds them; without the variable, the machine's own). Random blocks (nothing
from a hub), packed as the loader packs them:
- Q4_K as int4-vnni panels (`q4_gemm_vnni`): ffn gate+up 16384 x 2048, ffn down 2048 x 8192,
  o 2048 x 2048;
- Q6_K as q6k-vnni panels (`q6k_gemm_vnni`): ffn down 2048 x 8192, the LM head 49152 x 2048;
- a mixed qkv, 2560 rows of Q4_K then 512 of Q6_K (`gguf_gemm` with K-quant parts on int8
  activations, which packs them for the call where the CPU lacks VNNI), and the same on the
  float32 kernels.
A call's weights are one of 4 copies taken in turn, so calls of few rows read them from memory
as a decode step does. Prints a Markdown table of median milliseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from radixserve.model import kernels
from radixserve.model.gguf_quant import gguf_weight
from radixserve.model.kernels.matrix import PrefillPath
from radixserve.model.quant import QuantizedWeight, repacked_rows

Q4_K, Q6_K = 12, 14  # GGML types
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}  # per 256 weights
F16_AT = {Q4_K: (0, 2), Q6_K: (208,)}  # the blocks' float16 factors (d, dmin / d)
COPIES = 4


def random_blocks(kind: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """[rows, bytes] of random `kind` blocks: random codes and scales, small float16 factors."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in F16_AT[kind]:
        f = rng.uniform(0.001, 0.05, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., at : at + 2] = f[..., None].view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))


def panels(kind: int, rows: int, cols: int, seed: int) -> QuantizedWeight:
    w = gguf_weight(random_blocks(kind, rows, cols, seed), torch.tensor([[rows, kind]]), cols)
    packed = repacked_rows([w], path=PrefillPath.INT8_AVX2)
    assert packed.kind in ("int4-vnni", "q6k-vnni"), "this build has no AVX2 panels"
    return packed


def median_ms(calls: list[Callable[[], None]], reps: int) -> float:
    times = []
    for i in range(reps):
        t = time.perf_counter()
        calls[i % len(calls)]()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    args = ap.parse_args()
    assert kernels.load(), "radixserve's CPU kernels are unavailable"
    q4, q6, gg = kernels.op("q4_gemm_vnni"), kernels.op("q6k_gemm_vnni"), kernels.op("gguf_gemm")
    cases: dict[str, tuple[int, list[Callable[[torch.Tensor, torch.Tensor], None]]]] = {}
    for n, k in [(16384, 2048), (2048, 8192), (2048, 2048)]:
        ws = [panels(Q4_K, n, k, seed) for seed in range(COPIES)]
        cases[f"Q4_K {n} x {k}"] = (
            k, [lambda x, o, w=w: q4(x, w.qs, w.scale, w.minv, o) for w in ws]
        )  # fmt: skip
    for n, k in [(2048, 8192), (49152, 2048)]:
        ws = [panels(Q6_K, n, k, seed) for seed in range(COPIES)]
        cases[f"Q6_K {n} x {k}"] = (k, [lambda x, o, w=w: q6(x, w.qs, w.scale, o) for w in ws])
    layout = torch.tensor([[2560, Q4_K], [512, Q6_K]])
    mixed = [
        torch.cat([random_blocks(Q4_K, 2560, 2048, s).flatten(),
                   random_blocks(Q6_K, 512, 2048, s).flatten()])
        for s in range(COPIES)
    ]  # fmt: skip
    for label, int8 in (("int8 activations", True), ("float32 kernels", False)):
        cases[f"mixed qkv 3072 x 2048, {label}"] = (
            2048, [lambda x, o, b=b, i=int8: gg(x, b, layout, o, i) for b in mixed]
        )  # fmt: skip
    print(f"kernels: {kernels.compile_flags()}")
    print("| matrix | " + " | ".join(f"{m} rows (ms)" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name, (k, fns) in cases.items():
        n = int(name.split(" x ")[0].split()[-1])
        cells = []
        for m in args.rows:
            x, out = torch.randn(m, k), torch.empty(m, n)
            calls = [lambda f=f, x=x, out=out: f(x, out) for f in fns]
            calls[0]()  # warm-up
            cells.append(f"{median_ms(calls, max(8, 400 // m)):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
