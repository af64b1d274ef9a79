"""Attention backends over the paged KV pool: plan a step's metadata once, then attend per
layer. `sdpa` (torch's scaled_dot_product_attention over gathered blocks) runs anywhere; `cpu`
reads K/V from the pool in place with our C++ kernels; `triton` reads it in place on CUDA.

`BACKENDS` maps each `--attention-backend` name to its class; `select_backend` picks one by
the classes' `capabilities`. Importing this package does not import triton.
"""

from __future__ import annotations

import torch

from radixserve.model.attention.base import (
    AttendFn,
    AttentionBackend,
    AttentionPlan,
    BackendCapabilities,
    gather_blocks,
    planned,
    prefill_attention,
)
from radixserve.model.attention.cpu import CpuPagedBackend
from radixserve.model.attention.sdpa import SdpaBackend
from radixserve.model.attention.triton import TritonPagedBackend, triton_unavailable
from radixserve.values import ATTENTION_BACKENDS

__all__ = [
    "BACKENDS",
    "AttendFn",
    "AttentionBackend",
    "AttentionPlan",
    "BackendCapabilities",
    "CpuPagedBackend",
    "SdpaBackend",
    "TritonPagedBackend",
    "auto_backend",
    "gather_blocks",
    "kv_dtype_problem",
    "planned",
    "prefill_attention",
    "select_backend",
    "triton_unavailable",
]

# Every name of radixserve.values.ATTENTION_BACKENDS but "auto".
BACKENDS: dict[str, type[AttentionBackend]] = {
    "sdpa": SdpaBackend,
    "cpu": CpuPagedBackend,
    "triton": TritonPagedBackend,
}


def _auto_candidates(device: torch.device, dtype: torch.dtype, windowed: bool = False) -> list[str]:
    """The backends `auto` may pick for a `dtype` model on `device` (with sliding-window
    layers: those that compute windows), those that read the pool in place first (no
    per-layer copy of every context: at 2k-token contexts our CPU kernel is 4x faster than
    gathering for SDPA, and needs no padding to a batch's longest)."""
    serving = [
        n
        for n, cls in BACKENDS.items()
        if cls.capabilities.serves(device, dtype)
        and (cls.capabilities.sliding_window or not windowed)
    ]
    return sorted(serving, key=lambda n: not BACKENDS[n].capabilities.reads_pool_in_place)


def auto_backend(device: torch.device, dtype: torch.dtype, windowed: bool = False) -> str:
    """The backend `auto` means for a `dtype` model on `device`: the first candidate that can
    run here (`triton` on CUDA where triton imports; `cpu` for float32 on the CPU where our
    kernels load, building them once), else `sdpa`."""
    for name in _auto_candidates(device, dtype, windowed):
        if BACKENDS[name].unavailable_reason(device, dtype) is None:
            return name
    return "sdpa"


def kv_dtype_problem(
    name: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype
) -> str | None:
    """Why backend `name` cannot attend over K/V stored in `kv_dtype` for a `dtype` model
    (None when it can, or when `name` is no backend): the triton kernels read K/V in the
    model dtype only. For `auto`, asks which backend it means only where that matters."""
    if kv_dtype == dtype:
        return None
    if name == "auto":
        candidates = _auto_candidates(device, dtype)
        if all(BACKENDS[n].capabilities.reads_kv(dtype, kv_dtype) for n in candidates):
            return None  # whichever it picks: checking a CPU setup builds no kernels
        name = auto_backend(device, dtype)
    if name not in BACKENDS or BACKENDS[name].capabilities.reads_kv(dtype, kv_dtype):
        return None
    model, kv = (str(t).removeprefix("torch.") for t in (dtype, kv_dtype))
    return (
        f"the {name} attention backend reads K/V in the model dtype ({model}) only; "
        f"--kv-cache-dtype {kv} needs --attention-backend sdpa"
    )


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    windowed: bool = False,
) -> AttentionBackend:
    """The backend `name` asks for (`auto`: `auto_backend`), for a `dtype` model whose K/V
    pool holds `kv_dtype` (default: `dtype`), with sliding-window layers if `windowed`.
    Raises ValueError for an unknown name, a backend this setup cannot run, or a pool or
    windows it cannot attend over (auto's choice included)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {ATTENTION_BACKENDS}")
    chosen = auto_backend(device, dtype, windowed) if name == "auto" else name
    cls = BACKENDS[chosen]
    if name != "auto":
        why = cls.unavailable_reason(device, dtype)
        if why is not None:
            raise ValueError(f"--attention-backend {name} {why}")
        if windowed and not cls.capabilities.sliding_window:
            raise ValueError(
                f"--attention-backend {name} has no sliding-window attention, which this "
                "model's layers use; use --attention-backend sdpa (or auto)"
            )
    problem = kv_dtype_problem(chosen, device, dtype, kv_dtype or dtype)
    if problem:
        raise ValueError(problem)
    return cls()
