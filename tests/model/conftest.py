"""A tiny random Llama, built in the test, and its transformers twin."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.config import ModelConfig
from radixserve.model.llama import LlamaModel


def tiny_hf_config(**overrides: object):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[object, LlamaModel]:
    """(transformers LlamaForCausalLM, radixserve LlamaModel) with the same random weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf_cfg = tiny_hf_config()
    hf = LlamaForCausalLM(hf_cfg).eval()
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    ours = LlamaModel(cfg, torch.float32)
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours
