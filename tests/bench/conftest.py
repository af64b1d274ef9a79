"""Shared fixtures: the default model's tokenizer (no weights needed)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer; tests that need it skip if the model is not installed."""
    try:
        from radixserve.bench.cli import load_tokenizer

        return load_tokenizer(None)
    except Exception as e:  # ModelNotFoundError, missing transformers, ...
        pytest.skip(f"default model tokenizer unavailable: {e}")


@pytest.fixture(scope="session")
def counter(tokenizer):
    """A TokenCounter that measures with the real tokenizer."""
    from radixserve.bench.corpus import TokenCounter

    return TokenCounter(tokenizer)
