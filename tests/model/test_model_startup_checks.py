"""The start-up checks of the model layer and the option types, called in-process."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve import values
from radixserve.errors import KVPoolSizeError
from radixserve.model import kernels, loader
from radixserve.model.config import ModelConfig
from radixserve.model.files import missing_model_files
from radixserve.model.kv_pool import KVPool, check_pool_holds_request, free_memory
from radixserve.model.loader import dtype_problem, resolve_dtype
from radixserve.model.locks import file_lock
from radixserve.options import types as options

TINY = ModelConfig(
    vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("1.5G", 3 << 29),
        ("4096", 4096),
        ("10TB", 10 << 40),
    ],
)
def test_sizes_parse_in_binary_units(text: str, expected: int) -> None:
    assert values.parse_size(text) == expected


def test_suggested_sizes_parse_back_and_round_the_right_way() -> None:
    n = (22 << 30) + (850 << 20)  # 22.83 GiB
    assert values.format_size(n) == "22.8GiB"
    assert values.format_size(n, up=True) == "22.9GiB"
    assert values.parse_size(values.format_size(n)) <= n <= values.parse_size("22.9GiB")


@pytest.mark.parametrize("text", ["banana", "0", "2 GB of RAM", ""])
def test_memory_size_type_rejects_what_is_not_a_positive_size(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        options.memory_size(text)


def test_kv_pool_larger_than_free_memory_fails_before_allocating() -> None:
    free = free_memory(torch.device("cpu"))
    assert free is not None and free > 0
    # Twice the machine's memory, not just past what is free now: other processes freeing
    # memory between the two readings must not let the pool allocate (and the OOM killer in).
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_block = 2 * TINY.num_layers * 16 * TINY.num_kv_heads * TINY.head_dim * 4
    with pytest.raises(KVPoolSizeError, match="memory is free; lower --kv-cache-memory to"):
        KVPool(TINY, 2 * total // per_block + 1, 16, torch.float32)


def test_pool_smaller_than_one_request_names_both_remedies() -> None:
    check_pool_holds_request(64, 16, 1024, 1000)  # exactly one request: fine
    with pytest.raises(
        KVPoolSizeError, match="raise --kv-cache-memory to .* lower --max-model-len"
    ):
        check_pool_holds_request(63, 16, 1024, 1000)


def test_bfloat16_on_a_gpu_without_it_is_refused_and_cpus_run_every_dtype() -> None:
    cuda = torch.device("cuda:0")
    assert "bfloat16" in (dtype_problem("bfloat16", cuda, bf16_supported=False) or "")
    assert dtype_problem("bfloat16", cuda, bf16_supported=True) is None
    for dtype in ("float32", "float16", "bfloat16"):
        assert dtype_problem(dtype, torch.device("cpu"), bf16_supported=False) is None


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_auto_dtype_on_cpu_is_float32_for_quantized_weights_our_kernels_run(
    monkeypatch: pytest.MonkeyPatch, fast_bf16: bool
) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(loader, "_cpu_has_fast_bf16", lambda: fast_bf16)
    dense = torch.bfloat16 if fast_bf16 else torch.float32
    assert resolve_dtype("auto", cpu) == dense
    assert resolve_dtype("auto", cpu, quantized=True) == (
        torch.float32 if kernels.load() else dense
    )
    assert resolve_dtype("bfloat16", cpu, quantized=True) == torch.bfloat16  # asked for


def test_missing_model_files_lists_each_and_weights_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    missing = missing_model_files(tmp_path)
    assert missing[:2] == ["config.json", "tokenizer.json (or tokenizer.model)"]
    assert "pytorch_model.bin" in missing[2]
    assert len(missing_model_files(tmp_path, weights=False)) == 2


def test_file_lock_waits_for_the_process_holding_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.model.locks")
    lock = tmp_path / "m.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    assert holder.stdout.readline() == "locked\n"

    class ReleaseWhenWaiting(logging.Handler):
        """Tells the holder to finish once file_lock says it waits (not after a guessed time)."""

        def emit(self, record: logging.LogRecord) -> None:
            holder.stdin.write("go\n")  # type: ignore[union-attr]
            holder.stdin.flush()  # type: ignore[union-attr]

    release = ReleaseWhenWaiting()
    logger = logging.getLogger("radixserve.model.locks")
    logger.addHandler(release)
    try:
        with file_lock(lock, "waiting for the other one"):
            assert (tmp_path / "done").exists()  # the holder finished before we got the lock
    finally:
        logger.removeHandler(release)
        holder.stdin.close()
    assert holder.wait(30) == 0
    assert [r.getMessage() for r in caplog.records] == ["waiting for the other one"]


# Holds the lock until told to go on stdin (or a minute passes: a file_lock that never says it
# waits then fails the test instead of hanging it).
HOLD_LOCK = """
import fcntl, select, sys
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    print("locked", flush=True)
    select.select([sys.stdin], [], [], 60)
    open(sys.argv[1].replace("m.lock", "done"), "w").close()
"""
