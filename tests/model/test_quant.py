"""Weight-only int4/int8 linears: codes, our kernel and the dense fallback agree."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import kernels
from radixserve.model.attention import select_backend
from radixserve.model.batch import SeqChunk, build_batch
from radixserve.model.kv_pool import KVPool
from radixserve.model.quant import QuantizedWeight, QuantLinear, quantize, repacked
from radixserve.model.weights import quantize_model


@pytest.fixture(scope="module", autouse=True)
def built_kernels() -> None:
    assert kernels.load(), "the CPU kernels must build on this machine (a compiler and ninja)"


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantize_error_is_at_most_half_a_step(kind: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    q = quantize(w, kind)
    err = (q.dequantize() - w).abs().view(48, 3, 32)
    step = q.scale[..., None]
    assert bool((err <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("kind", ["int4", "int8"])
# 1: codes straight into the dot product; 2-16: codes in registers (AVX-512) or 4-row blocks;
# 8+ (17+ with AVX-512): packed 16-row panels under register tiles of 6 (AVX-512: 8) input
# rows, where 13 and 50 end on partial tiles
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 13, 50])
# 78: a last 4-row block and a last 16-row panel that are partial; 77: also an odd row count
# (one input row takes weight rows in pairs); 90: a last pair of panels (AVX-512 tiles take
# two) whose second panel is partial
@pytest.mark.parametrize("out_features", [80, 78, 77, 90])
# 416: more than one slice of K (192) in the AVX-512 panel GEMM, the last one short
@pytest.mark.parametrize("in_features", [160, 416])
def test_quant_linear_equals_dense_gemm_of_dequantized_weight(
    kind: str, rows: int, out_features: int, in_features: int
) -> None:
    torch.manual_seed(rows)
    q = quantize(torch.randn(out_features, in_features), kind)
    x = torch.randn(rows, in_features)
    want = F.linear(x, q.dequantize())
    got = QuantLinear(q)(x)
    assert got.shape == (rows, out_features)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())


def test_kernel_dequantize_equals_torch_unpacking() -> None:
    torch.manual_seed(1)
    for kind in ("int4", "int8"):
        q = quantize(torch.randn(16, 64), kind)
        n, k = q.shape
        if kind == "int4":
            assert q.minv is not None
            b = q.qs.view(n, k // 32, 16)
            codes = torch.cat([b & 0x0F, b >> 4], dim=-1).float()
            ref = (codes * q.scale[..., None] + q.minv[..., None]).view(n, k)
        else:
            ref = (q.qs.view(n, k // 32, 32).float() * q.scale[..., None]).view(n, k)
        # The kernel may fuse scale * q + min into one FMA: equal up to one rounding.
        torch.testing.assert_close(q.dequantize(), ref, rtol=1e-6, atol=1e-6)


def test_concat_stacks_rows() -> None:
    a, b = quantize(torch.randn(8, 64), "int4"), quantize(torch.randn(4, 64), "int4")
    both: QuantizedWeight = a.concat(b)
    assert both.shape == (12, 64)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_quantized_model_computes_what_its_dequantized_weights_compute(
    tiny_pair_factory,
) -> None:
    """A model whose dense weights equal its codes (as a GGUF's do) gives the same logits
    quantized, in decode (one row) and prefill (packed panels) steps alike."""
    _, dense = tiny_pair_factory(intermediate_size=128)
    _, quant = tiny_pair_factory(intermediate_size=128)
    quantize_model(quant, "int4")
    for layer_d, layer_q in zip(dense.decoder_layers(), quant.decoder_layers(), strict=True):
        for name in ("qkv_lin", "o_lin", "gate_up_lin", "down_lin"):
            lin = getattr(layer_q, name)
            getattr(layer_d, name).weight.copy_(lin.weight.dequantize())
    assert dense.lm_head is not None and isinstance(quant.head_lin, QuantLinear)
    dense.lm_head.copy_(quant.head_lin.weight.dequantize())
    dense.prepare()
    attn = select_backend("cpu", torch.device("cpu"), torch.float32)
    rng = random.Random(0)
    ids = [rng.randrange(101) for _ in range(30)]
    table = list(range(10))
    pools = [KVPool(m.config, 10, 4, torch.float32) for m in (dense, quant)]
    outs = []
    for m, pool in zip((dense, quant), pools, strict=True):
        prefill = m(build_batch([SeqChunk(ids, 0, table)], 4), pool, attn)
        decode = m(build_batch([SeqChunk([7], 30, table)], 4), pool, attn)
        outs.append((prefill, decode))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert (a - b).abs().max() <= 1e-4


def test_matrices_whose_width_is_not_a_multiple_of_32_stay_dense(tiny_pair_factory) -> None:
    _, model = tiny_pair_factory(intermediate_size=112)  # down_proj's in_features: 112
    quantize_model(model, "int8")
    layer = model.decoder_layers()[0]
    assert isinstance(layer.qkv_lin, QuantLinear)
    assert not isinstance(layer.down_lin, QuantLinear)


@pytest.mark.slow
def test_gguf_blocks_equal_the_exported_weights(default_model_files, default_hf_dir) -> None:
    from radixserve.model.gguf_quant import GgufWeights
    from radixserve.model.loader import load_state_dict

    assert default_model_files.gguf is not None
    stored = GgufWeights(default_model_files.gguf, default_model_files.path, 9, 3)
    dense = load_state_dict(default_hf_dir, torch.float32)
    assert stored["model.embed_tokens.weight"].kind == "gguf"  # Q8_0 blocks as stored
    assert repacked(stored["model.embed_tokens.weight"]).kind == "int8"  # the same values
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",  # rows permuted in the file
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    ):
        assert torch.equal(stored[name].dequantize(), dense[name]), name
        assert torch.equal(repacked(stored[name]).dequantize(), dense[name]), name
        assert torch.equal(stored.dense(name), dense[name]), name
    assert torch.equal(stored.dense("model.norm.weight"), dense["model.norm.weight"])
    assert "model.norm.weight" not in stored  # a float32 vector: no codes


@pytest.mark.parametrize("kind", ["gguf", "int8", "int4"])
def test_rows_of_the_codes_are_the_rows_of_the_dequantized_weight(kind: str) -> None:
    """An embedding lookup in the codes (a GGUF model's table is never dequantized whole)."""
    from radixserve.model.gguf_quant import gguf_weight

    torch.manual_seed(4)
    if kind == "gguf":
        blocks = torch.randint(0, 256, (5 * 2 * 34,), dtype=torch.uint8)  # 5 rows of 2 Q8_0
        blocks.view(5, 2, 34)[..., :2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)
        w = gguf_weight(blocks, torch.tensor([[5, 8]]), 64)
    else:
        w = quantize(torch.randn(5, 64), kind)
    ids = torch.tensor([3, 0, 3, 4])
    assert torch.equal(w.rows(ids), w.dequantize()[ids])


def test_float32_output_of_a_bfloat16_input_is_not_rounded_to_bfloat16() -> None:
    """Logits of a bf16 model come from the kernel's float32 sums: bf16's resolution (0.125
    at 25) would tie close logits."""
    torch.manual_seed(5)
    q = quantize(torch.randn(64, 96), "int8")
    x = torch.randn(3, 96).to(torch.bfloat16)
    want = F.linear(x.float(), q.dequantize())
    got = QuantLinear(q)(x, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    rounded = QuantLinear(q)(x)
    assert rounded.dtype == torch.bfloat16
    assert not torch.equal(rounded.float(), got)


@pytest.mark.slow
def test_a_gguf_model_directory_holds_no_weights(default_model_files) -> None:
    """The weights stay in the GGUF: what is written for it is its config, tokenizer and
    tensor index, a few megabytes."""
    from radixserve.model.loader import load_model

    model = load_model(default_model_files, torch.float32, torch.device("cpu"), None)
    assert model.embed.numel() == 0  # the table is looked up in the LM head's codes
    written = [p for p in default_model_files.path.rglob("*") if p.is_file()]
    assert not [p for p in written if p.suffix == ".safetensors"]
    assert sum(p.stat().st_size for p in written) < 8 * 2**20
