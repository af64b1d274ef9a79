"""CPU tensors on transparent huge pages (2 MiB), where Linux offers them.

A decode step streams every weight matrix and every sequence's K/V blocks once. On 4 KiB
pages each page is a TLB miss and a fresh start for the hardware prefetchers. Measured on a
2-core AMD EPYC (AVX2): one step's 120 int4 matrices from memory, 8-13% faster on huge pages
(four paired runs, e.g. 9.8 -> 8.5 ms); the decode step at 2k context, 3-4% faster.

Weights are written on 4 KiB pages, then moved onto huge pages from a background thread
(`HugeRegion.settle`), where Linux can (MADV_COLLAPSE, 6.1+). Written straight onto huge pages,
the 3B Q4_K_M's 1.9 GB loaded in 3.2-3.4 s on a 2-core VM, 2-3 ms per fresh 2 MiB page (likely
memory the host had taken back: the VM's balloon reports free pages to it); on 4 KiB pages in
1.45 s, then moved in 1.5-4.7 s while the server served.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import torch

from radixserve.values import ceil_div

log = logging.getLogger(__name__)

_MADV_HUGEPAGE, _MADV_NOHUGEPAGE, _MADV_COLLAPSE = 14, 15, 25  # Linux (COLLAPSE: 6.1+)
_HUGE_PAGE = 2 << 20
_SETTLE_STEP = 16 * _HUGE_PAGE  # per call: a call per 2 MiB moved 1.7 GB in 4.3 s against 2.1
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
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
    if end - start < _HUGE_PAGE:
        return False
    return _madvise(start, end - start, _MADV_HUGEPAGE)


def _madvise(start: int, length: int, advice: int) -> bool:
    """Linux's madvise over [start, start + length) (start page-aligned); whether it took."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0)
    except (OSError, AttributeError):
        return False


@functools.cache
def moves_onto_huge_pages() -> bool:
    """Whether Linux moves memory already written onto huge pages when asked (MADV_COLLAPSE)
    and transparent huge pages are not turned off (advice it does not know fails at once)."""
    if not sys.platform.startswith("linux") or not _THP.exists():
        return False
    return "[never]" not in _THP.read_text() and _madvise(0, 0, _MADV_COLLAPSE)


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


class HugeRegion:
    """A private anonymous mapping of `size` bytes (`buf`) for memory written once and read
    often: where Linux can move it onto huge pages later (`moves_onto_huge_pages`), its pages
    are 4 KiB ones while written, then `settle` moves them; elsewhere it is advised onto huge
    pages from the start. Only the pages written become resident."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._map = mmap.mmap(
            -1, max(size, 1),
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0),
        )  # fmt: skip
        self.buf = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the mapping alive
        if not moves_onto_huge_pages():
            advise_huge_pages(self.buf)
        elif size >= _HUGE_PAGE:  # 4 KiB pages even where every mapping gets huge ones
            _madvise(self.buf.data_ptr(), size, _MADV_NOHUGEPAGE)

    def settle(self, written: int) -> threading.Thread | None:
        """Move the first `written` bytes onto huge pages from a background thread (returned;
        queued instead inside a `MovesHeld`), where Linux can. They may be read and written
        meanwhile: Linux moves each 2 MiB under its own lock, as its khugepaged does. Pages
        first written after take huge pages."""
        if not moves_onto_huge_pages() or self.size < _HUGE_PAGE:
            return None
        start = self.buf.data_ptr()
        _madvise(start, self.size, _MADV_HUGEPAGE)  # undoes NOHUGEPAGE; needed by `always`
        move = (self.buf, ceil_div(start, _HUGE_PAGE) * _HUGE_PAGE, start + written)
        if MovesHeld.current is not None:
            MovesHeld.current.queued.append(move)
            return None
        return _start_moves([move])


_Move = tuple[torch.Tensor, int, int]  # a region's buffer (held meanwhile), [start, end)


class MovesHeld:
    """While entered, `HugeRegion.settle` queues its move; `start` starts the queued ones.
    A server holds them through its start-up: the move's copies and page-table work took
    0.3-0.5 s from a 2-core VM's start (a 1B or 3B Q4_K_M), and cost the requests that
    follow nothing they would not have paid on 4 KiB pages. Not for nesting or threads."""

    current: ClassVar[MovesHeld | None] = None

    def __init__(self) -> None:
        self.queued: list[_Move] = []

    def __enter__(self) -> MovesHeld:
        MovesHeld.current = self
        return self

    def __exit__(self, *exc: object) -> None:
        MovesHeld.current = None

    def start(self) -> threading.Thread | None:
        """Start the queued moves (each once), in the order queued."""
        moves, self.queued = self.queued, []
        return _start_moves(moves) if moves else None


def _start_moves(moves: list[_Move]) -> threading.Thread:
    thread = threading.Thread(
        target=_collapse, args=(moves,), name="radixserve-huge-pages", daemon=True
    )
    thread.start()
    return thread


def _collapse(moves: list[_Move]) -> None:
    """MADV_COLLAPSE over the huge pages of each move, a step at a time. A step Linux
    refuses (no free huge page) stays on 4 KiB pages."""
    begun, moved, total = time.perf_counter(), 0, 0
    for _, start, end in moves:
        total += max(end - start, 0)
        for at in range(start, end - _HUGE_PAGE + 1, _SETTLE_STEP):
            length = min(_SETTLE_STEP, end - at) // _HUGE_PAGE * _HUGE_PAGE
            moved += length if _madvise(at, length, _MADV_COLLAPSE) else 0
    log.info("huge pages: %d of %d MB of weights moved in %.2f s", moved >> 20, total >> 20,
             time.perf_counter() - begun)  # fmt: skip


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
        self._region = HugeRegion(total)
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
        view = self._region.buf[off : off + shape.numel() * dtype.itemsize].view(dtype)
        view = view.view(shape)
        view.copy_(t)
        if self._next == len(self._slots):
            self._region.settle(self._region.size)
        return view


class WeightArena:
    """A region of `capacity` bytes on huge pages (where Linux allows) that the loader writes
    weights into directly, one after another on 64-byte boundaries (`empty`): each weight is
    written once, where the kernels read it, instead of built elsewhere and packed. Only the
    pages written become resident (`settle` moves them onto huge pages once all are written).
    The region lives as long as any tensor in it.

    (Making the pages resident from a second thread ahead of the writer was slower: on a
    2-core VM, where a fresh 2 MiB page costs ~1.5 ms to fault in, 1B load 2.6-2.75 s
    against 1.95-2.1 s with the writer faulting alone.)"""

    def __init__(self, capacity: int) -> None:
        self._capacity = ceil_div(max(capacity, 1), _ALIGN) * _ALIGN
        self._region = HugeRegion(self._capacity)
        self._buf = self._region.buf
        self._base = self._buf.data_ptr()  # page-aligned
        self._next = 0

    def settle(self) -> threading.Thread | None:
        """Move what has been written onto huge pages (`HugeRegion.settle`)."""
        return self._region.settle(self._next)

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
