"""Checkpoint names into the model: every parameter has its transformers tensors, a missing one
is named, and a checkpoint's own codes are used as they are."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.quant import QuantLinear, quantize
from radixserve.model.weights import hf_names, load_hf_weights, quantize_model


@pytest.mark.parametrize("tie,bias", [(False, False), (True, True)])
def test_every_parameter_is_named_after_the_checkpoint_tensors_it_holds(
    tiny_pair_factory, tie: bool, bias: bool
) -> None:
    hf, model = tiny_pair_factory(tie_word_embeddings=tie, attention_bias=bias)
    names = hf_names(model.config)
    assert set(names) == {name for name, _ in model.named_parameters()}
    assert {n for parts in names.values() for n in parts} <= set(hf.state_dict())
    q, k, v = (hf.state_dict()[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(model.decoder_layers()[1].qkv, torch.cat([q, k, v]))


def test_a_missing_weight_is_named(tiny_pair_factory) -> None:
    hf, model = tiny_pair_factory()
    sd = dict(hf.state_dict())
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight missing"):
        load_hf_weights(model, sd)


def test_an_untied_head_missing_from_the_checkpoint_is_the_embedding_table(
    tiny_pair_factory,
) -> None:
    hf, model = tiny_pair_factory(tie_word_embeddings=False)
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    load_hf_weights(model, sd)
    assert model.lm_head is not None and torch.equal(model.lm_head, model.embed)


def test_stored_codes_of_one_kind_are_used_as_they_are(tiny_pair_factory) -> None:
    hf, model = tiny_pair_factory(intermediate_size=128)
    sd = hf.state_dict()
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    stored = {a + f"{x}_proj.weight": quantize(sd[a + f"{x}_proj.weight"], "int8") for x in "qkv"}
    stored[m + "gate_proj.weight"] = quantize(sd[m + "gate_proj.weight"], "int8")
    stored[m + "up_proj.weight"] = quantize(sd[m + "up_proj.weight"], "int4")  # kinds differ
    quantize_model(model, "int4", stored)
    layer = model.decoder_layers()[0]
    assert isinstance(layer.qkv_lin, QuantLinear) and layer.qkv_lin.weight.kind == "int8"
    want = torch.cat([stored[a + f"{x}_proj.weight"].dequantize() for x in "qkv"])
    assert torch.equal(layer.qkv_lin.weight.dequantize(), want)
    assert isinstance(layer.gate_up_lin, QuantLinear) and layer.gate_up_lin.weight.kind == "int4"
    assert layer.qkv.numel() == 0  # the dense copy is released
    assert model.quantization == "int4"
    names = [name for name, _ in model.quantized_weights()]
    assert names[:4] == [f"layers.0.{p}" for p in ("qkv_lin", "o_lin", "gate_up_lin", "down_lin")]
    assert names[-1] == "head_lin"
