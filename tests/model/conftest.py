"""A tiny random Llama, built in the test, and its transformers twin."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture(scope="module")
def tiny_pair(tiny_pair_factory: Callable[..., tuple]) -> tuple:
    """(transformers LlamaForCausalLM, radixserve DecoderModel) with the same random weights."""
    return tiny_pair_factory()
