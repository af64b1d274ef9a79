"""CPU tensors on transparent huge pages (2 MiB), where Linux offers them.

A decode step streams every weight matrix and every sequence's K/V blocks once. On 4 KiB
pages each page is a TLB miss and a fresh start for the hardware prefetchers. Measured on a
2-core AMD EPYC (AVX2): one step's 120 int4 matrices from memory, 8-13% faster on huge pages
(four paired runs, e.g. 9.8 -> 8.5 ms); the decode step at 2k context, 3-4% faster.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections.abc import Sequence

import torch

from radixserve.values import ceil_div

_MADV_HUGEPAGE = 14  # Linux
_ALIGN = 64  # bytes: a cache line, and any element size
# glibc's mallopt parameters, and its default limit on blocks given their own mapping
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_DEFAULT_MMAP_MAX = 65536


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the CPU tensor `t`'s untouched pages with 2 MiB pages (transparent
    huge pages in `madvise` mode, the common default); False where that is not possible."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    page = mmap.PAGESIZE
    start = ceil_div(t.data_ptr(), page) * page
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


def return_freed_memory_at_once() -> None:
    """Make glibc hand freed blocks of 1 MiB and more back to Linux at once (and return what
    it holds free now). By default it raises that threshold to the largest block freed so
    far, up to 32 MiB, and keeps smaller ones in its heap: the temporaries of repacking each
    weight at load then stayed resident, 1 GB on a 1B model."""
    _mallopt((_M_MMAP_MAX, _DEFAULT_MMAP_MAX), (_M_MMAP_THRESHOLD, 1 << 20), trim=True)


def reuse_freed_memory() -> None:
    """Make glibc keep freed memory for the next allocation (no block on its own mapping;
    up to 256 MiB free at the heap's top before it trims): a step's temporaries are then the
    same pages every step, where fresh mappings cost a page fault and Linux's zeroing each
    time. A 2.5k-token prefill of the 1B Q4_K_M on a Zen 4 VM: 9.6-11.8 -> 7.9-9.6 s. The
    heap fragments under large blocks, though (a 1B's 512-token step, 86 MB of live
    temporaries, grew it by about 300 MB): where our kernels are loaded, torch's blocks of 1
    MiB and more are kept by their own allocator instead (`kernels.keep_step_buffers`).
    `return_freed_memory_at_once` undoes it."""
    _mallopt((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 256 << 20))


def _mallopt(*settings: tuple[int, int], trim: bool = False) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        for param, value in settings:
            libc.mallopt(param, value)
        if trim:
            libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def zeros_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """torch.zeros(shape), on huge pages where the CPU allows (advised before the first touch).

    On the CPU the memory is a private anonymous mapping of its own: fresh pages of zeros
    that become resident only when first written, so a KV pool costs the memory of the
    blocks used so far, not its whole size (as torch.zeros would, writing every page at
    start), whatever glibc does with freed memory (`reuse_freed_memory`)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # unmapped with the last view
    t = torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
    advise_huge_pages(t)
    return t


def pack_on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of the CPU `tensors`, laid side by side in the order given (each on a
    64-byte boundary) in one buffer on huge pages where Linux allows: tensors read one after
    another then stream as one run of memory."""
    buffer = PackedBuffer([(t.shape, t.dtype) for t in tensors])
    return [buffer.place(t) for t in tensors]


class PackedBuffer:
    """One buffer on huge pages (where Linux allows) for tensors of the given shapes and
    dtypes, laid side by side in that order on 64-byte boundaries; `place` copies each in.
    Its pages become resident as they are written, so a caller that drops each source
    after placing it holds about one copy of the weights, never two."""

    def __init__(self, specs: Sequence[tuple[torch.Size | tuple[int, ...], torch.dtype]]):
        self._slots: list[tuple[int, torch.Size, torch.dtype]] = []
        total = 0
        for shape, dtype in specs:
            total = ceil_div(total, _ALIGN) * _ALIGN
            self._slots.append((total, torch.Size(shape), dtype))
            total += torch.Size(shape).numel() * dtype.itemsize
        self._buf = torch.empty(total + _ALIGN, dtype=torch.uint8)
        advise_huge_pages(self._buf)
        self._base = -self._buf.data_ptr() % _ALIGN
        self._next = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` in the next slot (its shape and dtype must be the slot's)."""
        if t.device.type != "cpu":
            raise ValueError(f"pack_on_huge_pages: a {t.device.type} tensor")
        off, shape, dtype = self._slots[self._next]
        if (t.shape, t.dtype) != (shape, dtype):
            raise ValueError(f"slot {self._next} holds {dtype} {tuple(shape)}, not {t.dtype} "
                             f"{tuple(t.shape)}")  # fmt: skip
        self._next += 1
        start = self._base + off
        view = self._buf[start : start + shape.numel() * dtype.itemsize].view(dtype).view(shape)
        view.copy_(t)
        return view


class WeightArena:
    """A region of `capacity` bytes on huge pages (where Linux allows) that the loader writes
    weights into directly, one after another on 64-byte boundaries (`empty`): each weight is
    written once, where the kernels read it, instead of built elsewhere and packed. Only the
    pages written become resident. The region lives as long as any tensor in it.

    (Making the pages resident from a second thread ahead of the writer was slower: on a
    2-core VM, where a fresh 2 MiB page costs ~1.5 ms to fault in, 1B load 2.6-2.75 s
    against 1.95-2.1 s with the writer faulting alone. Written on 4 KiB pages and moved onto
    huge pages after (MADV_COLLAPSE), the 3B Q4_K_M loaded in 1.45 s instead of 3.2-3.4, but
    the move paid the same faults later: moved at once, the first request after start took
    1.7-2.2 s to its first token instead of 0.4-0.7; moved only while idle, a busy server
    decoded 8-18% slower until it was; moved in steps while busy, at half speed for 18 s.)"""

    def __init__(self, capacity: int) -> None:
        self._capacity = ceil_div(max(capacity, 1), _ALIGN) * _ALIGN
        self._map = mmap.mmap(
            -1, self._capacity,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0),
        )  # fmt: skip
        self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        advise_huge_pages(self._buf)
        self._base = self._buf.data_ptr()  # page-aligned
        self._next = 0

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the region (torch.empty's once it is full)."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = ceil_div(self._next, _ALIGN) * _ALIGN
        if start + nbytes > self._capacity:
            return torch.empty(shape, dtype=dtype)
        self._next = start + nbytes
        return self._buf[start : start + nbytes].view(dtype).view(shape)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory is in the region."""
        return self._base <= t.data_ptr() < self._base + self._capacity
