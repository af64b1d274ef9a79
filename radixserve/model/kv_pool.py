"""The paged KV-cache pool: preallocated K/V storage addressed by block id."""

from __future__ import annotations

import re

import torch

from radixserve.model.config import ModelConfig

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_memory(size: str | int) -> int:
    """Bytes of a size such as 2GiB, 512MiB, 1.5G or a plain integer."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", size)
    if not m:
        raise ValueError(f"cannot parse memory size {size!r} (e.g. 2GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """KV bytes one token occupies across all layers (K and V)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * elem


class KVPool:
    """K and V tensors of shape [num_layers, num_blocks, block_size, num_kv_heads, head_dim].

    Allocated once at construction; a block id indexes dim 1. Nothing is allocated later.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def blocks_for_memory(
        config: ModelConfig, memory: str | int, block_size: int, dtype: torch.dtype
    ) -> int:
        """How many blocks of `block_size` tokens fit in `memory` bytes of K+V."""
        per_block = bytes_per_token(config, dtype) * block_size
        return max(1, parse_memory(memory) // per_block)

    def blocks(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V as [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.k[i], self.v[i]
