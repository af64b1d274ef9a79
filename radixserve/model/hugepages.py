"""CPU tensors on transparent huge pages (2 MiB), where Linux offers them.

A decode step streams every weight matrix and every sequence's K/V blocks once. On 4 KiB
pages each page is a TLB miss and a fresh start for the hardware prefetchers. Measured on a
2-core AMD EPYC (AVX2): one step's 120 int4 matrices from memory, 8-13% faster on huge pages
(four paired runs, e.g. 9.8 -> 8.5 ms); the decode step at 2k context, 3-4% faster.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from radixserve.model.quant import QuantizedWeight, QuantLinear

if TYPE_CHECKING:
    from radixserve.model.llama import LlamaModel

_MADV_HUGEPAGE = 14  # Linux
_ALIGN = 64  # bytes: a cache line, and any element size


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the CPU tensor `t`'s untouched pages with 2 MiB pages (transparent
    huge pages in `madvise` mode, the common default); False where that is not possible."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = t.data_ptr() + t.numel() * t.element_size()
    if end - start < 2 * 1024 * 1024:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
        )
    except (OSError, AttributeError):
        return False


def zeros_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """torch.zeros(shape), on huge pages where the CPU allows (advised before the first touch)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t.zero_()


def pack_on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of the CPU `tensors`, laid side by side in the order given (each on a
    64-byte boundary) in one buffer on huge pages where Linux allows: tensors read one after
    another then stream as one run of memory."""
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"pack_on_huge_pages: a {t.device.type} tensor")
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    buf = torch.empty(total + _ALIGN, dtype=torch.uint8)
    advise_huge_pages(buf)
    base = -buf.data_ptr() % _ALIGN
    packed = []
    for t, off in zip(tensors, offsets, strict=True):
        size = t.numel() * t.element_size()
        view = buf[base + off : base + off + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        packed.append(view)
    return packed


def pack_model_weights(model: LlamaModel) -> None:
    """On CPU, move the weights a forward step reads (`model.step_weights()`: norms,
    projections or their codes, the LM head) into one buffer on huge pages, in the order the
    step reads them: the step then streams one run of memory instead of ~250 scattered
    tensors. Call after quantizing; the computation is unchanged."""
    if model.embed.device.type != "cpu":
        return
    moves: list[tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], None]]] = []

    def tensor(t: torch.Tensor | None) -> None:
        if t is not None and t.numel():
            moves.append(([t.data], lambda new: setattr(t, "data", new[0])))

    def codes(lin: QuantLinear) -> None:
        w = lin.weight
        parts = [w.qs, w.scale] + ([w.minv] if w.minv is not None else [])

        def use(new: list[torch.Tensor]) -> None:
            minv = new[2] if len(new) > 2 else None
            lin.use_weight(QuantizedWeight(w.kind, new[0], new[1], minv))

        moves.append((parts, use))

    for read in model.step_weights():
        if isinstance(read, torch.Tensor):  # a norm
            tensor(read)
            continue
        if isinstance(read, QuantLinear):
            codes(read)
        else:
            tensor(read.weight)  # the dense parameter itself
        tensor(read.bias)
    packed = iter(pack_on_huge_pages([t for parts, _ in moves for t in parts]))
    for parts, use in moves:
        use([next(packed) for _ in parts])
    model.weights_moved()
