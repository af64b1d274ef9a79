"""The paged KV-cache pool: preallocated K/V storage addressed by block id."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from radixserve.errors import KVPoolSizeError, ModelTooLargeError
from radixserve.model.config import ModelConfig
from radixserve.model.hugepages import zeros_on_huge_pages
from radixserve.values import ceil_div, format_size, parse_size

# Share of the free memory a suggested --kv-cache-memory leaves the pool (the rest: activations).
FIT_FRACTION = 0.9


def parse_memory(size: str | int) -> int:
    """Bytes of a size such as 2GiB, 512MiB, 1.5G or a plain integer; ValueError otherwise."""
    return parse_size(size)


def free_memory(device: torch.device) -> int | None:
    """Bytes that can be allocated on `device` now (None where that is unknown).

    CUDA: the driver's free memory. CPU: /proc/meminfo's MemAvailable, capped by the cgroup's
    memory limit when the process runs under one.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int(used)))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_pool_fits_memory(nbytes: int, device: torch.device, copies: int = 1) -> None:
    """Raise KVPoolSizeError, saying what is free and what would fit, unless `copies` pools of
    `nbytes` each fit in the memory free on `device`."""
    free = free_memory(device)
    if free is None or nbytes * copies <= free:
        return
    one, fits = format_size(nbytes, up=True), format_size(free * FIT_FRACTION / copies)
    need = f"{copies} workers x {one}" if copies > 1 else one
    raise KVPoolSizeError(
        f"the KV pool (--kv-cache-memory) needs {need} but only {format_size(free)} of "
        f"{device.type} memory is free; lower --kv-cache-memory to {fits} or less"
    )


def check_model_fits_memory(need: int, what: str, device: torch.device) -> None:
    """Raise ModelTooLargeError unless `need` bytes (the most loading `what` holds at once:
    `loader.load_memory`) fit the memory free on `device`."""
    free = free_memory(device)
    if free is None or need <= free:
        return
    raise ModelTooLargeError(
        f"the model ({what}) needs about {format_size(need, up=True)} of {device.type} memory "
        f"to load, but only {format_size(free)} is free"
    )


def check_pool_holds_request(
    num_blocks: int, block_size: int, max_model_len: int, bytes_per_block: int
) -> None:
    """Raise KVPoolSizeError if `num_blocks` cannot hold one request of `max_model_len` tokens."""
    need = ceil_div(max_model_len, block_size)
    if num_blocks >= need:
        return
    raise KVPoolSizeError(
        f"the KV pool holds {num_blocks * block_size} tokens ({num_blocks} blocks x "
        f"{block_size}), fewer than one request of --max-model-len {max_model_len} needs; "
        f"raise --kv-cache-memory to {format_size(need * bytes_per_block, up=True)} or lower "
        f"--max-model-len to {num_blocks * block_size}"
    )


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """KV bytes one token occupies across all layers (K and V)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * elem


class KVPool:
    """K and V tensors of shape [num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim].

    Allocated once at construction; a block id indexes dim 1. Nothing is allocated later.
    Block `scratch_block` (= num_blocks, never handed out) takes the K/V that padding rows
    of a compiled or captured step write.

    With `window_slots` (a model with sliding-window layers), those layers keep their K/V in
    `k_window` / `v_window` [window layers, window_slots + 1, ...] instead, addressed by the
    slot a block holds there (radixserve.cache.window); `k` / `v` hold the other layers, and
    `layer_pools[i]` says where layer i's K/V is (p < len(k): k[p], else k_window[p - len(k)]).
    Slot `window_slots` is the window pool's scratch slot.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        window_slots: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
        layers = range(config.num_layers)
        windowed = [i for i in layers if window_slots and config.layer_window(i)]
        full = [i for i in layers if i not in windowed]
        self.window_slots = window_slots if windowed else None
        self.layer_pools = [0] * config.num_layers
        for p, i in enumerate(full + windowed):
            self.layer_pools[i] = p
        self.layer_pool_ids = torch.tensor(self.layer_pools, dtype=torch.long)  # for kernels
        row = (block_size, config.num_kv_heads, config.head_dim)
        shape = (len(full), num_blocks + 1, *row)
        window_shape = (len(windowed), (self.window_slots or 0) + 1, *row)
        elem = torch.tensor([], dtype=dtype).element_size()
        nbytes = 2 * (math.prod(shape) + math.prod(window_shape)) * elem
        check_pool_fits_memory(nbytes, torch.device(device))
        try:
            self.k = zeros_on_huge_pages(shape, dtype, torch.device(device))
            self.v = zeros_on_huge_pages(shape, dtype, torch.device(device))
            self.k_window = zeros_on_huge_pages(window_shape, dtype, torch.device(device))
            self.v_window = zeros_on_huge_pages(window_shape, dtype, torch.device(device))
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise KVPoolSizeError(
                f"cannot allocate the KV pool ({format_size(nbytes)}): {str(e).splitlines()[0]}; "
                "lower --kv-cache-memory"
            ) from e

    def in_window_pool(self, i: int) -> bool:
        """Whether layer i keeps its K/V in the window pool (by slot, not block id)."""
        return self.layer_pools[i] >= self.k.shape[0]

    @staticmethod
    def blocks_for_memory(
        config: ModelConfig, memory: str | int, block_size: int, dtype: torch.dtype
    ) -> int:
        """How many blocks of `block_size` tokens fit in `memory` bytes of K+V."""
        per_block = bytes_per_token(config, dtype) * block_size
        return max(1, parse_memory(memory) // per_block)

    def blocks(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V as [num_blocks, block_size, num_kv_heads, head_dim] (in the
        window pool: [window_slots + 1, ...])."""
        p = self.layer_pools[i]
        if p < self.k.shape[0]:
            return self.k[p], self.v[p]
        return self.k_window[p - self.k.shape[0]], self.v_window[p - self.k.shape[0]]
