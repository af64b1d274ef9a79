"""int8-avx2 holds a GGUF's Q4_K matrices as int4-vnni panels (their blocks' own factors) and
its Q6_K matrices as q6k-vnni panels, and runs every row of them there (gemm_panels_avx2.cpp,
gemm_q6k_vnni.cpp's q6k_rows_avx2; on a CPU with AVX-512 VNNI the same ops run vnni_tile and
q6k_tile, with the same arithmetic): each row is the exact product of its int8 activations and
gguf's dequantization, to float32 summation, and gets its bits whatever shares the call.
test_gguf_kernels.py's AVX2-only build runs this file too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.model import kernels
from radixserve.model.gguf_quant import gguf_weight
from radixserve.model.kernels.matrix import PrefillPath, available_paths
from radixserve.model.quant import QuantizedWeight, QuantLinear, repacked_rows
from tests.model.test_gguf_kernels import dequantized, random_blocks, weight_of
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


def q6k_panels(seed: int) -> tuple[object, QuantizedWeight]:
    """Random Q6_K blocks [80, 768] and the same as q6k-vnni panels (two parts, as a fused
    matrix's)."""
    blocks = random_blocks("Q6_K", 80, 768, seed=seed)
    parts = [
        gguf_weight(torch.from_numpy(b.copy()), torch.tensor([[b.shape[0], 14]]), 768)
        for b in (blocks[:48], blocks[48:])
    ]
    return blocks, repacked_rows(parts, path=PrefillPath.INT8_AVX2)


def run_q6k(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0])
    kernels.op("q6k_gemm_vnni")(x, w.qs, w.scale, out)
    return out


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 9, 33])
def test_q6k_panels_give_the_product_of_int8_activations_and_the_blocks(rows: int) -> None:
    """Passes of 4 rows over each panel (1-8 rows streaming the panels, as decode steps do)."""
    needs_int8_avx2()
    blocks, w = q6k_panels(seed=rows)
    assert w.kind == "q6k-vnni"
    x = torch.randn(rows, 768)
    want = q8_activations(x) @ dequantized(blocks, "Q6_K").double().T
    got = run_q6k(x, w)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2e-5 * scale
    assert (got - gemm_q8(x, blocks, "Q6_K")).abs().max().item() <= 2e-5 * scale


def test_q6k_panels_give_each_row_its_bits_alone() -> None:
    needs_int8_avx2()
    _, w = q6k_panels(seed=5)
    wide = torch.randn(11, 1024)
    x = wide[:, :768]  # rows 1024 apart: the kernel reads x by its row stride
    together = run_q6k(x, w)
    for r in range(11):
        assert torch.equal(run_q6k(x[r : r + 1], w)[0], together[r])


def test_a_mixed_matrix_s_chunks_run_its_k_quant_parts_on_panels_packed_for_the_call() -> None:
    """A Q4_K_M's mixed qkv (Q4_K rows, then Q6_K) stays as stored on int8-avx2; its prefill
    chunks (gguf_gemm's int8 flag) take int8 activations: on an AVX2-only CPU, each part on
    panels packed for the call, which give the load-time panels' bits; on AVX-512 VNNI,
    kquant_gemm_vnni. Either way each part is its int8 product with the blocks."""
    needs_int8_avx2()
    q4_blocks, q4 = q4k_panels(64, 768, seed=7)
    q6_blocks, q6 = q6k_panels(seed=7)
    assert q4.kind == "int4-vnni" and q6.kind == "q6k-vnni"
    mixed = weight_of([("Q4_K", q4_blocks), ("Q6_K", q6_blocks)], 768)
    lin = QuantLinear(mixed)
    lin.use_prefill_path(PrefillPath.INT8_AVX2)
    assert lin.weight.kind == "gguf"
    x = torch.randn(24, 768)
    got = lin(x, fp32_rows=0)
    want = torch.cat([gemm_q8(x, q4_blocks, "Q4_K"), gemm_q8(x, q6_blocks, "Q6_K")], dim=1)
    assert (got - want).abs().max().item() <= 2e-5 * want.abs().max().item()
    if PrefillPath.INT8_VNNI not in available_paths():  # the panels packed for the call
        assert torch.equal(got, torch.cat([run(x, q4), run_q6k(x, q6)], dim=1))


def test_int8_avx2_runs_q6k_on_its_panels_and_fp32_reads_the_blocks() -> None:
    needs_int8_avx2()
    blocks, w = q6k_panels(seed=13)
    lin = QuantLinear(w)
    lin.use_prefill_path(PrefillPath.INT8_AVX2)
    assert lin.weight.kind == "q6k-vnni"
    x = torch.randn(40, 768)
    assert torch.equal(lin(x, fp32_rows=3), run_q6k(x, w))
    qs, _, _, layout = lin.decode_operands()  # decode_layers' quant_linear
    assert qs is w.qs and layout.tolist() == [[80, kernels.quant_kind_code("q6k-vnni")]]
    lin.use_prefill_path(PrefillPath.FP32)
    assert lin.weight.kind == "gguf"
    dense = x.double() @ dequantized(blocks, "Q6_K").double().T
    assert (lin(x).double() - dense).abs().max().item() <= 1e-4 * dense.abs().max().item()


@pytest.mark.slow
def test_the_avx2_build_gives_the_vnni_builds_bits(tmp_path: Path) -> None:
    """The panels' rows on vpmaddubsw (an AVX2-only build, as AMD Zen 3 runs) equal those on
    vpdpbusd bit for bit, Q4_K's, Q6_K's and Q4_0's (float16 factors), for calls of decode
    rows (1, 2: whole panels a pass; 8: half panels) and of a prefill chunk (in a
    subprocess: one build per process)."""
    assert kernels.load()
    if PrefillPath.INT8_VNNI not in available_paths():
        pytest.skip("this CPU has no AVX-512 VNNI to compare with")
    torch.manual_seed(0)
    x = torch.randn(13, 768)
    _, q4 = q4k_panels(32, 768, seed=3)
    _, q6 = q6k_panels(seed=3)
    q40_blocks = torch.from_numpy(random_blocks("Q4_0", 32, 768, seed=4))
    q40 = repacked_rows(
        [gguf_weight(q40_blocks, torch.tensor([[32, 2]]), 768)], path=PrefillPath.INT8_VNNI
    )
    assert q40.scale.dtype == torch.float16
    torch.save(
        {"x": x, "q4": q4.tensors(), "q6": q6.tensors(), "q40": q40.tensors()}, tmp_path / "in.pt"
    )
    code = (
        "import sys, torch\n"
        "from radixserve.model import kernels\n"
        "assert kernels.load() and '-mavx512f' not in kernels.compile_flags()\n"
        "d = torch.load(sys.argv[1])\n"
        "x, (q4, s4, m4), (q6, s6) = d['x'], d['q4'], d['q6']\n"
        "outs = []\n"
        "for n in (1, 2, 8, 13):\n"
        "    a, b, c = torch.empty(n, 32), torch.empty(n, 80), torch.empty(n, 32)\n"
        "    kernels.op('q4_gemm_vnni')(x[:n], q4, s4, m4, a)\n"
        "    kernels.op('q6k_gemm_vnni')(x[:n], q6, s6, b)\n"
        "    kernels.op('q4_gemm_vnni')(x[:n], *d['q40'], c)\n"
        "    outs.append((a, b, c))\n"
        "torch.save(outs, sys.argv[2])\n"
    )
    env = dict(os.environ, RADIXSERVE_CPU_ISA="avx2")
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for (a, b, c), n in zip(torch.load(tmp_path / "out.pt"), (1, 2, 8, 13), strict=True):
        assert torch.equal(a, run(x[:n], q4)) and torch.equal(b, run_q6k(x[:n], q6)), n
        assert torch.equal(c, run(x[:n], q40)), n
