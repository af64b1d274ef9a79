"""The int8 paths' decode rows on GGUF blocks as stored, against int8 activations (gguf_q8.cpp).
Each block kind gives the exact product of the activations' int8 codes and gguf's own
dequantization (to float32 summation; F16 / BF16 matrices: of the float32 activations), and
each input row gets its bits whatever shares the call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.model import kernels
from radixserve.model.gguf_quant import SERVED_TYPES, gguf_weight
from radixserve.model.kernels.matrix import PrefillPath
from radixserve.model.quant import GGUF_VNNI_MIN_ROWS, QuantLinear
from tests.model.test_gguf_kernels import dequantized, random_blocks

gguf = pytest.importorskip("gguf")
GGML = {t: int(gguf.GGMLQuantizationType[t]) for t in SERVED_TYPES}
FLOATS = ("F16", "BF16")  # 16-bit weights: met by the float32 activations as they are


def needs_int8_avx2() -> None:
    assert kernels.load()
    if PrefillPath.INT8_AVX2.value not in kernels.op("matrix_units")():
        pytest.skip("this build has no AVX2 kernels")


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x quantized to int8 per group of 32 and back (scale max|x| / 127, ties to even)."""
    g = x.double().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    scale = (amax / 127.0).float().double()  # the kernel keeps the scale in float32
    return (torch.round((g.float() * inv.float()).double()) * scale).reshape(x.shape)


def gemm_q8(x: torch.Tensor, blocks: np.ndarray, type_name: str) -> torch.Tensor:
    rows = blocks.shape[0]
    layout = torch.tensor([[rows, GGML[type_name] + kernels.quant_kind_code("gguf-q8")]])
    out = torch.empty(x.shape[0], rows)
    kernels.op("gguf_gemm_q8")(x, torch.from_numpy(blocks.reshape(-1).copy()), layout, out)
    return out


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("type_name", SERVED_TYPES)
def test_q8_kernel_is_the_product_of_int8_activations_and_the_blocks(
    type_name: str, rows: int
) -> None:
    needs_int8_avx2()
    blocks = random_blocks(type_name, 24, 512, seed=rows)
    x = torch.randn(rows, 512)
    activations = x.double() if type_name in FLOATS else q8_activations(x)
    want = activations @ dequantized(blocks, type_name).double().T
    got = gemm_q8(x, blocks, type_name)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2e-5 * scale + 1e-6


@pytest.mark.parametrize("type_name", SERVED_TYPES)
def test_q8_kernel_gives_each_row_its_bits_alone(type_name: str) -> None:
    """9 rows: groups of 2, 4 or 8 and a partial last group, each row as computed alone."""
    needs_int8_avx2()
    blocks = random_blocks(type_name, 20, 512, seed=7)
    x = torch.randn(9, 512)
    together = gemm_q8(x, blocks, type_name)
    for r in range(9):
        assert torch.equal(gemm_q8(x[r : r + 1].contiguous(), blocks, type_name)[0], together[r])


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_k_quant_chunks_on_vnni_are_the_product_of_int8_activations_and_the_blocks(
    rows: int,
) -> None:
    """gguf_gemm with int8_vnni (int8-vnni's prefill chunks): Q2_K ... Q6_K and the i-quants'
    parts take int8 activations, as the decode rows do, to float32 summation; other kinds stay
    float32."""
    needs_int8_avx2()
    if not kernels.load() or PrefillPath.INT8_VNNI.value not in kernels.op("matrix_units")():
        pytest.skip("this CPU or build has no AVX-512 VNNI")
    kinds = ["Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS",
             "IQ2_S", "IQ3_XXS", "IQ3_S", "Q8_0"]  # fmt: skip
    parts = [random_blocks(k, 32 if k == "Q5_K" else 16, 512, seed=i) for i, k in enumerate(kinds)]
    blocks = torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]))
    layout = torch.tensor([[p.shape[0], GGML[k]] for p, k in zip(parts, kinds, strict=True)])
    x = torch.randn(rows, 512)
    out = torch.empty(rows, int(layout[:, 0].sum()))
    kernels.op("gguf_gemm")(x, blocks, layout, out, True)
    col = 0
    for p, k in zip(parts, kinds, strict=True):
        got, dense = out[:, col : col + p.shape[0]], dequantized(p, k)
        col += p.shape[0]
        if k == "Q8_0":
            torch.testing.assert_close(got, x @ dense.T, rtol=1e-4, atol=1e-4)
            continue
        want = q8_activations(x) @ dense.double().T
        assert (got.double() - want).abs().max().item() <= 2e-5 * want.abs().max().item(), k


PATHS = [
    PrefillPath.INT8_AVX2,
    PrefillPath.INT8_VNNI,
    PrefillPath.AMX_BF16,
    PrefillPath.AVX512_BF16,
]


@pytest.mark.parametrize("path", PATHS)
def test_stored_blocks_run_decode_rows_in_int8_and_long_chunks_as_the_path_says(
    path: PrefillPath,
) -> None:
    """A QuantLinear of Q4_K and Q6_K parts (a Q4_K_M qkv) as stored, on the int8 paths and on
    the bfloat16 ones (whose tiles read int4 / int8 codes only, so such blocks stay as
    stored): its first `fp32_rows` (decode rows) take int8 activations, a chunk of the path's
    `min_rows` or more after them int8 activations too (int8-vnni and the bfloat16 paths on
    AVX-512 VNNI; int8-avx2 on panels packed for the call), and each decode row's result is
    the one it gets alone."""
    needs_int8_avx2()
    if path.value not in kernels.op("matrix_units")():
        pytest.skip(f"this CPU or build does not run {path.value}")
    q4k, q6k = random_blocks("Q4_K", 32, 256, seed=1), random_blocks("Q6_K", 16, 256, seed=2)
    blocks = torch.from_numpy(np.concatenate([q4k.reshape(-1), q6k.reshape(-1)]))
    lin = QuantLinear(gguf_weight(blocks, torch.tensor([[32, 12], [16, 14]]), 256))
    lin.use_prefill_path(path)
    assert lin.prefill_path is path
    assert lin.silu_gated(torch.randn(16, 256), fp32_rows=2) is None  # no tile reads blocks
    dense = torch.cat([dequantized(q4k, "Q4_K"), dequantized(q6k, "Q6_K")])
    long_rows = GGUF_VNNI_MIN_ROWS if path is PrefillPath.INT8_VNNI else path.min_rows
    x = torch.randn(2 + long_rows + 2, 256)  # 2 decode rows, then a long chunk
    out = lin(x, fp32_rows=2)
    chunk = (q8_activations(x[2:]) @ dense.double().T).float()
    # Against the largest output, as below: an elementwise 1e-4 failed about one run in ten.
    assert (out[2:] - chunk).abs().max().item() <= 2e-5 * chunk.abs().max().item() + 1e-6
    int8 = q8_activations(x[:2]) @ dense.double().T
    # As the kernel test's bound: float32 sums against the largest output (Q6_K's -32 offset
    # cancels against its codes' products, so a small output carries the big ones' rounding).
    assert (out[:2].double() - int8).abs().max().item() <= 2e-5 * int8.abs().max().item() + 1e-6
    assert torch.equal(lin(x[:1].contiguous())[0], out[0])
    qs, _, _, layout = lin.decode_operands()  # what decode_layers takes: the same kernel
    assert layout[:, 1].tolist() == [12 + 1000, 14 + 1000]


def test_on_int8_vnni_stored_blocks_take_the_gemm_from_its_own_threshold() -> None:
    """int8-vnni's GEMM packs K-quant blocks into panels at every call: below
    GGUF_VNNI_MIN_ROWS rows (the LM head of an 8-sequence decode step) they stay on the decode
    rows' kernel, each row what it gets alone; from it on, the GEMM (other bits)."""
    if not kernels.load() or PrefillPath.INT8_VNNI.value not in kernels.op("matrix_units")():
        pytest.skip("this CPU or build does not run int8-vnni")
    assert GGUF_VNNI_MIN_ROWS > PrefillPath.INT8_VNNI.min_rows
    q6k = random_blocks("Q6_K", 64, 256, seed=3)
    lin = QuantLinear(gguf_weight(torch.from_numpy(q6k.reshape(-1)), torch.tensor([[64, 14]]), 256))
    lin.use_prefill_path(PrefillPath.INT8_VNNI)
    x = torch.randn(GGUF_VNNI_MIN_ROWS, 256)
    short = lin(x[: GGUF_VNNI_MIN_ROWS - 1])
    alone = torch.cat([lin(x[r : r + 1]) for r in range(GGUF_VNNI_MIN_ROWS)])
    assert torch.equal(short, alone[:-1])
    assert not torch.equal(lin(x), alone)


def test_on_int8_vnni_other_stored_blocks_keep_the_paths_threshold() -> None:
    """Q8_0 blocks as stored (the default model's tied LM head) are not packed per call: from
    the path's min_rows on they take its GEMM (float32 block kernels), as before."""
    if not kernels.load() or PrefillPath.INT8_VNNI.value not in kernels.op("matrix_units")():
        pytest.skip("this CPU or build does not run int8-vnni")
    q8 = random_blocks("Q8_0", 64, 256, seed=4)
    lin = QuantLinear(gguf_weight(torch.from_numpy(q8.reshape(-1)), torch.tensor([[64, 8]]), 256))
    lin.use_prefill_path(PrefillPath.INT8_VNNI)
    rows = PrefillPath.INT8_VNNI.min_rows
    x = torch.randn(rows, 256)
    alone = torch.cat([lin(x[r : r + 1]) for r in range(rows)])
    assert torch.equal(lin(x[: rows - 1]), alone[:-1])
    assert not torch.equal(lin(x), alone)
