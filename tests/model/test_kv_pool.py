"""The KV pool's memory: zeroed, and on huge pages where Linux offers them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.model.config import ModelConfig
from radixserve.model.kv_pool import KVPool, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding `address` may be backed by transparent huge pages."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return False


def test_pool_starts_zeroed() -> None:
    config = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=128,
    )  # fmt: skip
    pool = KVPool(config, 1200, 16, torch.float32)  # K and V 2.5 MB each: advised
    assert not pool.k.any() and not pool.v.any()


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_large_cpu_tensors_are_advised_onto_huge_pages() -> None:
    big = torch.empty(8 << 20, dtype=torch.uint8)
    assert advise_huge_pages(big)
    assert _thp_eligible(big.data_ptr() + (4 << 20))
    assert not advise_huge_pages(torch.empty(1024))  # under one huge page: left alone
