"""The KV pool's memory starts zeroed (its huge pages: test_hugepages.py)."""

from __future__ import annotations

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.kv_pool import KVPool


def test_pool_starts_zeroed() -> None:
    config = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=128,
    )  # fmt: skip
    pool = KVPool(config, 1200, 16, torch.float32)  # K and V 2.5 MB each: advised
    assert not pool.k.any() and not pool.v.any()
