"""Engines over a tiny random Llama (fast) or the real default model (exact checks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.decoder import DecoderModel


@pytest.fixture(scope="session")
def tiny_llama(tiny_pair_factory: Callable[..., tuple]) -> DecoderModel:
    """A 2-layer random Llama with the default tokenizer's vocabulary, shared by the session
    (engines only read its weights)."""
    _, model = tiny_pair_factory(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    return model


@pytest.fixture
def make_tiny_engine(
    tiny_llama: DecoderModel, default_tokenizer: Tokenizer
) -> Callable[..., LLMEngine]:
    """Build an unstarted engine over the tiny model; keyword args go to EngineConfig."""

    def make(**kw: Any) -> LLMEngine:
        small = dict(block_size=4, num_blocks=64, max_num_batched_tokens=64)
        cfg = EngineConfig(**{**small, **kw})  # a misspelt option is a TypeError
        return LLMEngine.from_parts(cfg, tiny_llama, default_tokenizer, "tiny")

    return make
