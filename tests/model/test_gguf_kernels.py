"""GGUF blocks computed as stored: for each block type, our kernels' product equals the gguf
package's own dequantization followed by a float32 matmul, at 1, 8 and 64 input rows (decode
GEMV, the few-row path, the prefill panel GEMM), and a matrix whose rows mix types (a Q4_K_M
file's q/k/v) equals its parts. The AVX2-only build passes the same tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve.model import kernels
from radixserve.model.gguf_quant import SERVED_TYPES, gguf_weight
from radixserve.model.quant import QuantLinear, _as_codes, repacked, repacked_rows

gguf = pytest.importorskip("gguf")

# Byte offsets of each type's float16 scale fields within a block (set to sane values: random
# bytes there would be infinities and NaNs).
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
}


@pytest.fixture(scope="module", autouse=True)
def built_kernels() -> None:
    assert kernels.load(), "the CPU kernels must build on this machine (a compiler and ninja)"


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] of random blocks of `type_name`: random codes, scales and mins
    (F16 / BF16: random normal weights)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    weights, nbytes = gguf.quants.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if type_name in ("F16", "BF16"):
        w = rng.normal(0.0, 0.05, size=(rows, cols)).astype(np.float32)
        if type_name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(rows, -1)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, size=(rows, cols // weights, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        scales = rng.uniform(0.001, 0.05, size=blocks.shape[:2]) * rng.choice(
            [-1, 1], blocks.shape[:2]
        )
        blocks[..., at : at + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def dequantized(blocks: np.ndarray, type_name: str) -> torch.Tensor:
    """gguf's own dequantization, float32."""
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))


def weight_of(parts: list[tuple[str, np.ndarray]], cols: int):
    layout = torch.tensor(
        [[b.shape[0], int(gguf.GGMLQuantizationType[t])] for t, b in parts], dtype=torch.int64
    )
    raw = np.concatenate([b.reshape(-1) for _, b in parts])
    return gguf_weight(torch.from_numpy(raw.copy()), layout, cols)


def assert_product_equals_dequantized(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x @ w.T  # float32
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("type_name", SERVED_TYPES)
def test_block_kernel_equals_gguf_dequantization_then_matmul(type_name: str, rows: int) -> None:
    """40 weight rows (a partial 16-row panel), 512 weights a row (two K-quant super-blocks;
    sixteen 32-weight blocks)."""
    cols = 512
    blocks = random_blocks(type_name, 40, cols, seed=rows)
    w = weight_of([(type_name, blocks)], cols)
    torch.manual_seed(rows)
    x = torch.randn(rows, cols)
    out = torch.empty(rows, 40)
    kernels.op("gguf_gemm")(x, w.qs, w.layout, out)
    assert_product_equals_dequantized(out, x, dequantized(blocks, type_name))


@pytest.mark.parametrize("type_name", SERVED_TYPES)
def test_kernel_dequantization_equals_gguf(type_name: str) -> None:
    blocks = random_blocks(type_name, 7, 256, seed=3)
    got = weight_of([(type_name, blocks)], 256).dequantize()
    torch.testing.assert_close(got, dequantized(blocks, type_name), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_a_matrix_of_mixed_block_types_equals_its_parts(rows: int) -> None:
    """Q4_K_M stores q and k in one type and v in another; fused, the rows keep their own."""
    cols = 256
    parts = [("Q4_K", 24), ("Q4_K", 8), ("Q6_K", 8), ("Q5_0", 5)]
    blocks = [(t, random_blocks(t, n, cols, seed=i)) for i, (t, n) in enumerate(parts)]
    fused = weight_of(blocks[:1], cols)
    for part in blocks[1:]:
        fused = fused.concat(weight_of([part], cols))
    assert fused.layout is not None and fused.layout.tolist() == [
        [32, int(gguf.GGMLQuantizationType.Q4_K)],
        [8, int(gguf.GGMLQuantizationType.Q6_K)],
        [5, int(gguf.GGMLQuantizationType.Q5_0)],
    ]
    torch.manual_seed(rows)
    x = torch.randn(rows, cols)
    want_w = torch.cat([dequantized(b, t) for t, b in blocks])
    assert_product_equals_dequantized(QuantLinear(fused)(x), x, want_w)


REPACKED = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int8", "Q8_0": "int8"}


@pytest.mark.parametrize("type_name", sorted(REPACKED))
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_blocks_whose_values_int4_or_int8_codes_hold_repack_into_them_exactly(
    type_name: str, rows: int
) -> None:
    """Q8_0 / Q5_0 matrices run on gemm.cpp's int8 kernels, Q4_0 / Q4_1 / Q4_K ones on its
    int4 kernels: the same values (bit for bit), so the same products."""
    blocks = random_blocks(type_name, 16, 512, seed=5)
    w = repacked(weight_of([(type_name, blocks)], 512))
    assert w.kind == REPACKED[type_name]
    assert torch.equal(w.dequantize(), dequantized(blocks, type_name))
    torch.manual_seed(rows)
    x = torch.randn(rows, 512)
    assert_product_equals_dequantized(QuantLinear(w)(x), x, dequantized(blocks, type_name))


def test_fused_parts_repack_together_only_into_one_kind_of_codes() -> None:
    """Q4_K_M's q/k in Q5_0 with v in Q8_0 fuse into one int8 matrix; Q4_K with Q4_0 into one
    int4 matrix; a part no codes hold (Q6_K) keeps the fused matrix in its blocks."""
    cols = 256
    made = {t: random_blocks(t, 8, cols, seed=i) for i, t in enumerate(REPACKED)}
    made["Q6_K"] = random_blocks("Q6_K", 8, cols, seed=9)
    for parts, kind in (
        (["Q5_0", "Q8_0", "Q5_0"], "int8"),
        (["Q4_K", "Q4_0", "Q4_1"], "int4"),
        (["Q4_K", "Q6_K"], "gguf"),
        (["Q5_0", "Q4_0"], "gguf"),
    ):
        fused = weight_of([(parts[0], made[parts[0]])], cols)
        for t in parts[1:]:
            fused = fused.concat(weight_of([(t, made[t])], cols))
        w = repacked(fused)
        assert w.kind == kind, parts
        assert torch.equal(w.dequantize(), torch.cat([dequantized(made[t], t) for t in parts]))


def test_the_repacking_kernel_writes_the_reference_codes_part_by_part() -> None:
    """kernels' gguf_repack, given a matrix's parts one by one (as the loader reads q, k and
    v), writes byte for byte the codes, scales and mins of the torch reference `_as_codes`
    over the parts concatenated, for every kind that repacks."""
    cols = 512
    for parts in (["Q5_0", "Q8_0", "Q5_0"], ["Q4_K", "Q4_0", "Q4_1"], ["Q4_K"], ["Q8_0"]):
        made = [random_blocks(t, 8 + 3 * i, cols, seed=i) for i, t in enumerate(parts)]
        w = repacked_rows([weight_of([(t, b)], cols) for t, b in zip(parts, made, strict=True)])
        ref = [
            _as_codes(torch.from_numpy(b), int(gguf.GGMLQuantizationType[t]), cols, b.shape[1]
                      // (cols // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0]))
            for t, b in zip(parts, made, strict=True)
        ]  # fmt: skip
        assert torch.equal(
            w.qs.view(torch.uint8), torch.cat([q for q, _, _ in ref]).view(torch.uint8)
        )
        assert torch.equal(w.scale, torch.cat([s for _, s, _ in ref]))
        if w.kind == "int4":
            assert w.minv is not None
            assert torch.equal(w.minv, torch.cat([m for _, _, m in ref if m is not None]))


@pytest.mark.parametrize(
    "type_name", [*SERVED_TYPES, *(f"{t} as {kind}" for t, kind in sorted(REPACKED.items()))]
)
def test_exact_rows_give_each_row_its_result_alone(type_name: str) -> None:
    """Within kernels.exact_rows() (a step verifying speculative drafts), up to 16 input rows
    each get bit for bit their output alone: a drafted row never changes a greedy token. Rows
    of 32-weight blocks are 17 groups long, so the kernels' last G % 8 groups are covered."""
    name, _, _ = type_name.partition(" ")
    cols = 544 if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0] == 32 else 512
    blocks = random_blocks(name, 40, cols, seed=9)
    w = weight_of([(name, blocks)], cols)
    if " as " in type_name:
        w = repacked(w)
        assert w.kind == type_name.split()[-1]
    lin = QuantLinear(w)
    torch.manual_seed(9)
    x = torch.randn(16, cols)
    alone = torch.cat([lin(x[r : r + 1]) for r in range(16)])
    with kernels.exact_rows():
        for rows in (2, 3, 6, 9, 16):
            assert torch.equal(lin(x[:rows]), alone[:rows]), rows
    fast = lin(x[:6])  # the faster default: equal up to summation order
    assert (fast - alone[:6]).abs().max() <= 1e-5 * alone[:6].abs().max()


def test_rows_that_are_not_whole_blocks_are_refused_by_name() -> None:
    blocks = random_blocks("Q4_K", 2, 256, seed=1)
    w = weight_of([("Q4_K", blocks)], 256)
    with pytest.raises(RuntimeError, match="q4_k rows of 288 weights are not whole blocks"):
        kernels.op("gguf_gemm")(torch.randn(1, 288), w.qs, w.layout, torch.empty(1, 2))


@pytest.mark.slow
def test_the_avx2_only_build_passes_the_same_tests(tmp_path: Path) -> None:
    """RADIXSERVE_CPU_ISA=avx2 builds the kernels as an AVX2-only CPU (AMD Zen 3) runs them;
    this file's tests and test_panels_avx2.py's (int8-avx2's panels) pass on that build too
    (in a subprocess: one build per process)."""
    env = dict(os.environ, RADIXSERVE_CPU_ISA="avx2")
    flags = "from radixserve.model import kernels; print(kernels.compile_flags())"
    probe = subprocess.run(
        [sys.executable, "-c", flags], env=env, capture_output=True, text=True, check=True
    )
    assert "-mavx2" in probe.stdout and "-mavx512f" not in probe.stdout
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         str(Path(__file__).with_name("test_panels_avx2.py")),
         "-k", "not avx2_only_build and not vnni_builds_bits"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
