"""Shared fixtures: the default model's tokenizer (no weights needed)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (the setup script installs the model; a missing one fails)."""
    from radixserve.bench.cli import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def counter(tokenizer):
    """A TokenCounter that measures with the real tokenizer."""
    from radixserve.bench.corpus import TokenCounter

    return TokenCounter(tokenizer)
