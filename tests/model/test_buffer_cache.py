"""The CPU allocator that keeps a step's large freed buffers for the next (buffer_cache.cpp):
reuse within twice the size, the limit, least recently freed out first, small tensors as
before, and no buffer handed out twice across threads."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from radixserve.model import kernels

MiB = 1 << 20


@pytest.fixture
def cache() -> Iterator[None]:
    """The allocator installed, with nothing kept, and its default limit restored after."""
    assert kernels.load(), "the CPU kernels must build on this machine (a compiler and ninja)"
    kernels.keep_step_buffers(0)  # unmaps whatever earlier tests left kept
    kernels.keep_step_buffers()
    yield
    kernels.keep_step_buffers()


def _buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def test_a_freed_buffer_serves_the_next_request_it_fits(cache: None) -> None:
    t = _buffer(37 * MiB)
    address = t.data_ptr()
    before = kernels.step_buffer_stats()
    del t
    assert kernels.step_buffer_stats()["kept_bytes"] == before["kept_bytes"] + 38 * MiB
    u = _buffer(36 * MiB + 5)  # rounds to the same 2 MiB step... or within twice: reused
    after = kernels.step_buffer_stats()
    assert u.data_ptr() == address
    assert after["reused"] == before["reused"] + 1 and after["mapped"] == before["mapped"]
    assert after["kept_bytes"] == before["kept_bytes"]
    u.fill_(7)
    assert int(u.sum()) == 7 * u.numel()


def test_a_buffer_more_than_twice_the_request_is_not_taken(cache: None) -> None:
    big = _buffer(20 * MiB)
    address = big.data_ptr()
    del big
    before = kernels.step_buffer_stats()
    small = _buffer(4 * MiB)
    after = kernels.step_buffer_stats()
    assert small.data_ptr() != address
    assert after["mapped"] == before["mapped"] + 1
    assert after["kept_bytes"] == before["kept_bytes"] == 20 * MiB


def test_kept_bytes_stay_within_the_limit_oldest_freed_out_first(cache: None) -> None:
    kernels.keep_step_buffers(10 * MiB)
    a, b = _buffer(6 * MiB), _buffer(6 * MiB)
    b_address = b.data_ptr()
    mapped = kernels.step_buffer_stats()["mapped_bytes"]
    del a  # kept: 6 MiB
    del b  # 12 MiB > 10: a, freed first, is unmapped
    stats = kernels.step_buffer_stats()
    assert stats["kept_bytes"] == 6 * MiB
    assert stats["mapped_bytes"] == mapped - 6 * MiB
    assert _buffer(6 * MiB).data_ptr() == b_address
    kernels.keep_step_buffers(0)
    assert kernels.step_buffer_stats()["kept_bytes"] == 0


def test_small_tensors_are_not_its_buffers(cache: None) -> None:
    before = kernels.step_buffer_stats()
    ts = [torch.full((1000,), float(i)) for i in range(100)]
    assert [float(t[0]) for t in ts] == [float(i) for i in range(100)]
    del ts
    assert kernels.step_buffer_stats() == before


def test_threads_never_share_a_buffer(cache: None) -> None:
    errors: list[str] = []

    def work(k: int) -> None:
        for i in range(40):
            n = (1 + (i * 7 + k) % 5) * MiB + 123  # sizes that share buffers across threads
            t = torch.full((n // 4,), float(k), dtype=torch.float32)
            torch.mul(t, 1.0, out=t)  # some time holding it
            if not bool((t == float(k)).all()):
                errors.append(f"thread {k}, round {i}: another thread wrote into its buffer")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert kernels.step_buffer_stats()["reused"] > 0


def test_loading_a_model_on_the_cpu_installs_it(default_model_files) -> None:
    """In a process of its own (the default model's directory written by the fixture): torch's
    default allocator until a model is loaded, then this one (a large tensor is its mapping)."""
    code = f"""
import torch
from radixserve.model import kernels
from radixserve.model.files import resolve_model
from radixserve.model.loader import load_model
assert kernels.load()
x = torch.empty({3 * MiB}, dtype=torch.uint8)
assert kernels.step_buffer_stats()["mapped"] == 0
load_model(resolve_model(None), torch.float32, torch.device("cpu"), None)
x = torch.empty({3 * MiB}, dtype=torch.uint8)
stats = kernels.step_buffer_stats()
assert stats["mapped"] + stats["reused"] >= 1, stats
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
