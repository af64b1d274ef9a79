"""An engine refuses, at construction, a KV pool that cannot hold one request."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from radixserve.engine.engine import LLMEngine
from radixserve.errors import KVPoolSizeError


def test_pool_smaller_than_max_model_len_is_a_start_up_error(
    make_tiny_engine: Callable[..., LLMEngine],
) -> None:
    with pytest.raises(KVPoolSizeError, match="--max-model-len 1024"):
        make_tiny_engine(max_model_len=1024, num_blocks=8)  # 8 blocks x 4 tokens


def test_pool_of_exactly_one_request_starts(make_tiny_engine: Callable[..., LLMEngine]) -> None:
    engine = make_tiny_engine(max_model_len=32, num_blocks=8)
    assert engine.num_blocks * engine.block_size == engine.max_model_len
