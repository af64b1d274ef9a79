"""The KV offload tier's storage: host memory or a memory-mapped file, and the block mover.

The radix cache decides which block ids move between the pool and the tier; this module
moves the bytes. A tier holds K and V in the pool's layout, [num_layers, num_blocks,
block_size, num_kv_heads, head_dim], so a block copies with one gather and one scatter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.kv_pool import KVPool, bytes_per_token, parse_memory

TIER_FILE = "radixserve-kv-offload.bin"


class KVStore(Protocol):
    """Anything holding K and V tensors in the pool's layout (a KVPool or a tier)."""

    k: torch.Tensor
    v: torch.Tensor


class KVTier:
    """K and V of `num_blocks` blocks outside the pool; a block id indexes dim 1."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, where: str) -> None:
        self.k, self.v = k, v
        self.num_blocks = k.shape[1]
        self.where = where

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return 2 * self.k.numel() * self.k.element_size()


def _shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)


class HostKVTier(KVTier):
    """A tier in host memory (pinned when the pool is on a GPU, for fast copies)."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, pin: bool
    ) -> None:
        shape = _shape(config, num_blocks, block_size)
        k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        super().__init__(k, v, "host memory")


class DiskKVTier(KVTier):
    """A tier in a memory-mapped file under `directory` (created, or reused and resized).

    The page cache keeps recently used blocks in RAM; the rest lives on disk. The file's
    contents mean nothing across runs: blocks are written before they are read.
    """

    def __init__(
        self,
        directory: str | Path,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        path = Path(directory) / TIER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        shape = _shape(config, num_blocks, block_size)
        numel = 1
        for d in shape:
            numel *= d
        elem = torch.tensor([], dtype=dtype).element_size()
        with open(path, "ab") as f:  # sparse: only written blocks take disk space
            f.truncate(2 * numel * elem)
        flat = torch.from_file(str(path), shared=True, size=2 * numel, dtype=dtype)
        super().__init__(flat[:numel].view(shape), flat[numel:].view(shape), str(path))
        self.path = path


def tier_blocks_for(
    config: ModelConfig,
    memory: str | int | None,
    directory: str | None,
    pool_blocks: int,
    block_size: int,
    dtype: torch.dtype,
) -> int:
    """Blocks of the offload tier: `memory` of K+V, or 4x the pool for a file without one."""
    if memory is None:
        return 4 * pool_blocks if directory else 0
    per_block = bytes_per_token(config, dtype) * block_size
    return parse_memory(memory) // per_block


def open_kv_tier(
    config: ModelConfig,
    pool: KVPool,
    memory: str | int | None,
    directory: str | None,
) -> KVTier | None:
    """The tier `--kv-offload-memory` / `--kv-offload-dir` ask for, or None for no tier.

    With a directory the tier is a memory-mapped file there (of `memory` bytes, default
    four times the pool); with only `memory` it is host memory.
    """
    dtype = pool.k.dtype
    n = tier_blocks_for(config, memory, directory, pool.num_blocks, pool.block_size, dtype)
    if n <= 0:
        if memory is not None or directory:
            raise ValueError(f"--kv-offload-memory {memory} holds less than one KV block")
        return None
    if directory:
        return DiskKVTier(directory, config, n, pool.block_size, dtype)
    return HostKVTier(config, n, pool.block_size, dtype, pin=pool.k.is_cuda)


def gather_blocks(store: KVStore, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of K and V of `blocks`, as [num_layers, len(blocks), block_size, heads, dim]."""
    idx = torch.tensor(blocks, dtype=torch.long, device=store.k.device)
    return store.k.index_select(1, idx), store.v.index_select(1, idx)


def scatter_blocks(store: KVStore, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write K and V (as `gather_blocks` returns them) into `blocks` of `store`."""
    idx = torch.tensor(blocks, dtype=torch.long, device=store.k.device)
    store.k.index_copy_(1, idx, k.to(store.k.device))
    store.v.index_copy_(1, idx, v.to(store.v.device))


class KVTierMover:
    """The radix cache's `BlockMover` over a KVPool and a KVTier: copies K/V by block id."""

    def __init__(self, pool: KVStore, tier: KVTier) -> None:
        self.pool = pool
        self.tier = tier

    def demote(self, pool_blocks: list[int], tier_blocks: list[int]) -> None:
        """Copy pool blocks into tier blocks (the cache frees the pool blocks after)."""
        k, v = gather_blocks(self.pool, pool_blocks)
        scatter_blocks(self.tier, tier_blocks, k, v)

    def promote(self, tier_blocks: list[int], pool_blocks: list[int]) -> None:
        """Copy tier blocks into pool blocks (the cache frees the tier blocks after)."""
        k, v = gather_blocks(self.tier, tier_blocks)
        scatter_blocks(self.pool, pool_blocks, k, v)
