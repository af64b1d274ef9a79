"""Value types every layer shares: memory sizes, the names of dtypes, devices, attention
backends and quantizations, and ceiling division.

The bottom of the package (it imports nothing of ours): the cache, the model, the option
declarations (`radixserve.config`) and the command line all read these names from here, so a
name is spelled once. Parsers raise ValueError; nothing here imports torch.
"""

from __future__ import annotations

import math
import re


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, for positive b (blocks for a number of tokens, pages for bytes)."""
    return -(-a // b)


# Weights' dtype (--dtype): auto picks per device (radixserve.model.loader.resolve_dtype).
DTYPES = ("auto", "float32", "bfloat16", "float16")
# K/V storage dtype (--kv-cache-dtype): auto stores K/V in the model dtype (vLLM's and SGLang's
# meaning).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPE_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
# Attention kernels (--attention-backend); radixserve.model.attention registers one backend
# per name but auto.
ATTENTION_BACKENDS = ("auto", "sdpa", "cpu", "triton")
# Weight-only quantization of the projections (--quantization).
# gguf: a GGUF file's own blocks as it stores them (CPU; the default there).
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
# Waiting-queue order (--schedule-policy): longest cached prefix first, or arrival order.
SCHEDULE_POLICIES = ("lpm", "fcfs")
# Python logging levels, lower-cased (--log-level).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# vLLM accepts block sizes 1..256; larger blocks make prefix sharing too coarse to pay.
MAX_BLOCK_SIZE = 256

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)(i?[bB])?\s*")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def parse_size(size: str | int) -> int:
    """Bytes of a size such as 2GiB, 512MiB, 1.5G or a plain integer (binary units).

    Raises ValueError when `size` is not such a size.
    """
    if isinstance(size, int):
        return size
    m = _SIZE.fullmatch(size)
    if not m:
        raise ValueError(f"cannot parse memory size {size!r} (e.g. 2GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float, up: bool = False) -> str:
    """`n` bytes as a --kv-cache-memory value to one decimal (22.8GiB, 512MiB), rounded down
    (or up when `up`)."""
    rnd = math.ceil if up else math.floor
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{rnd(n / scale * 10) / 10:g}{unit}"
    return f"{rnd(n)}B"


def kv_cache_dtype_name(text: str) -> str:
    """One of KV_CACHE_DTYPES for `text` (bf16, fp16, fp32 and half are aliases); ValueError
    for anything else, with fp8 named as unsupported."""
    value = text.strip().lower()
    value = KV_CACHE_DTYPE_ALIASES.get(value, value)
    if value in KV_CACHE_DTYPES:
        return value
    if value.startswith("fp8"):
        raise ValueError(
            f"{text!r}: fp8 KV caches are not supported; use auto, bfloat16 or float16"
        )
    raise ValueError(f"{text!r}: use one of {', '.join(KV_CACHE_DTYPES)}")


def device_name(text: str) -> str:
    """`text` as a device name, auto | cpu | cuda | cuda:N (lower-cased); ValueError otherwise.

    Only the spelling is checked: whether CUDA is there is the model loader's question.
    """
    value = text.strip().lower()
    if not _DEVICE.fullmatch(value):
        raise ValueError(f"unknown device {text!r}; use auto, cpu, cuda or cuda:N")
    return value
