"""int8-avx2 holds a GGUF's Q4_K matrices as int4-vnni panels (their blocks' own factors) and
runs every row of them there (gemm_panels_avx2.cpp; on a CPU with AVX-512 VNNI the same op
runs vnni_tile, with the same arithmetic): each row is the exact product of its int8
activations and gguf's dequantization, to float32 summation, and gets its bits whatever
shares the call."""

from __future__ import annotations

import pytest
import torch

from radixserve.model import kernels
from radixserve.model.gguf_quant import gguf_weight
from radixserve.model.kernels.matrix import PrefillPath, available_paths
from radixserve.model.quant import QuantizedWeight, QuantLinear, repacked_rows
from tests.model.test_gguf_kernels import dequantized, random_blocks
from tests.model.test_gguf_q8 import gemm_q8, q8_activations

pytest.importorskip("gguf")


def needs_int8_avx2() -> None:
    assert kernels.load()
    if PrefillPath.INT8_AVX2 not in available_paths():
        pytest.skip("this build has no AVX2 kernels")


def q4k_panels(rows: int, cols: int, seed: int) -> tuple[object, QuantizedWeight]:
    """Random Q4_K blocks [rows, cols] and the same as int4-vnni panels (two parts: a fused
    matrix's, packed part by part)."""
    blocks = random_blocks("Q4_K", rows, cols, seed=seed)
    half = rows // 2
    parts = [
        gguf_weight(torch.from_numpy(b.copy()), torch.tensor([[b.shape[0], 12]]), cols)
        for b in (blocks[:half], blocks[half:])
    ]
    return blocks, repacked_rows(parts, path=PrefillPath.INT8_AVX2)


def run(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0])
    kernels.op("q4_gemm_vnni")(x, w.qs, w.scale, w.minv, out)
    return out


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 33])
def test_q4k_panels_give_the_product_of_int8_activations_and_the_blocks(rows: int) -> None:
    """To float32 summation, as gguf_q8.cpp's rows over the same blocks as stored."""
    needs_int8_avx2()
    blocks, w = q4k_panels(64, 512, seed=rows)
    assert w.kind == "int4-vnni" and w.scale.dtype == torch.uint8
    x = torch.randn(rows, 512)
    want = q8_activations(x) @ dequantized(blocks, "Q4_K").double().T
    got = run(x, w)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2e-5 * scale
    assert (got - gemm_q8(x, blocks, "Q4_K")).abs().max().item() <= 2e-5 * scale


def test_q4k_panels_give_each_row_its_bits_alone() -> None:
    """11 rows: passes of 4 and a partial last one; a row alone, or strided in a wider x."""
    needs_int8_avx2()
    _, w = q4k_panels(48, 768, seed=5)
    wide = torch.randn(11, 1024)
    x = wide[:, :768]  # rows 1024 apart: the kernel reads x by its row stride
    together = run(x, w)
    for r in range(11):
        assert torch.equal(run(x[r : r + 1], w)[0], together[r])
    assert torch.equal(run(x.contiguous(), w), together)


def test_int8_avx2_keeps_q4k_panels_and_fp32_reads_them_as_codes() -> None:
    """QuantLinear on int8-avx2 computes on the panels (decode rows and prefill chunks alike);
    on fp32 it holds the same values as int4 codes and computes in float32."""
    needs_int8_avx2()
    blocks, w = q4k_panels(32, 512, seed=11)
    lin = QuantLinear(w)
    lin.use_prefill_path(PrefillPath.INT8_AVX2)
    assert lin.weight.kind == "int4-vnni"
    x = torch.randn(40, 512)
    got = lin(x, fp32_rows=3)
    assert torch.equal(got, run(x, w))
    lin.use_prefill_path(PrefillPath.FP32)
    assert lin.weight.kind == "int4"
    dense = x.double() @ dequantized(blocks, "Q4_K").double().T
    assert (lin(x).double() - dense).abs().max().item() <= 1e-4 * dense.abs().max().item()
