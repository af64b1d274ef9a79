"""Engines over a tiny random Llama (fast) or the real default model (exact checks)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from radixserve.engine.engine import EngineConfig, LLMEngine
from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.config import ModelConfig
from radixserve.model.llama import LlamaModel


def tiny_model(vocab: int = 49152, seed: int = 0) -> LlamaModel:
    """A 2-layer random Llama with the default tokenizer's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    hf = LlamaForCausalLM(hf_cfg)
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    model = LlamaModel(cfg, torch.float32)
    model.load_hf_state_dict(hf.state_dict())
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaModel:
    """One tiny model for the whole session (engines only read its weights)."""
    return tiny_model()


@pytest.fixture
def make_tiny_engine(
    tiny_llama: LlamaModel, default_tokenizer: Tokenizer
) -> Callable[..., LLMEngine]:
    """Build an unstarted engine over the tiny model; keyword args go to EngineConfig."""

    def make(**kw: object) -> LLMEngine:
        cfg = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64)
        for k, v in kw.items():
            setattr(cfg, k, v)
        return LLMEngine.from_parts(cfg, tiny_llama, default_tokenizer, "tiny")

    return make
