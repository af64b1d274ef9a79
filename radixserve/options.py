"""argparse value types shared by every command: a bad value fails at parse time, exit 2.

Each returns the parsed value or raises `argparse.ArgumentTypeError`, which argparse turns
into `radixserve CMD: error: argument --flag: <message>`. None imports torch except `device`
when CUDA is asked for.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# --attention-backend values (radixserve.model.attention implements them).
ATTENTION_BACKENDS = ("auto", "sdpa", "cpu", "triton")
# --kv-cache-dtype values: auto stores K/V in the model dtype (vLLM's and SGLang's meaning).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
_KV_CACHE_DTYPE_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
# vLLM accepts block sizes 1..256; larger blocks make prefix sharing too coarse to pay.
MAX_BLOCK_SIZE = 256

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]?)(i?[bB])?\s*")


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


def memory_size(text: str) -> str:
    """A positive memory size (kept as text, so it can be passed on to worker processes)."""
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size (e.g. 2GiB, 512MiB)")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """A type: a whole number in [lo, hi] (no upper bound when hi is None)."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < lo or (hi is not None and value > hi):
            bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {bound}")
        return value

    return parse


def float_in(lo: float, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
    """A type: a finite number >= lo (> lo when lo_open) and <= hi."""

    def parse(text: str) -> float:
        value = _float(text)
        if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
            low = f"more than {lo:g}" if lo_open else f"at least {lo:g}"
            bound = f"{low} and at most {hi:g}" if hi is not None else low
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: must be {bound}")
        return value

    return parse


positive_int = int_in(1)
non_negative_int = int_in(0)
positive_float = float_in(0.0, lo_open=True)
non_negative_float = float_in(0.0)
fraction = float_in(0.0, 1.0)
port = int_in(1, 65535)
block_size = int_in(1, MAX_BLOCK_SIZE)


def kv_cache_dtype(text: str) -> str:
    """auto | float32 | bfloat16 | float16 (bf16, fp16 and fp32 are accepted as aliases)."""
    value = text.strip().lower()
    value = _KV_CACHE_DTYPE_ALIASES.get(value, value)
    if value in KV_CACHE_DTYPES:
        return value
    if value.startswith("fp8"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: fp8 KV caches are not supported; use auto, bfloat16 or float16"
        )
    raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(KV_CACHE_DTYPES)}")


def device(text: str) -> str:
    """auto | cpu | cuda | cuda:N, where CUDA must be usable on this machine."""
    value = text.strip().lower()
    if value in ("auto", "cpu"):
        return value
    from radixserve.errors import DeviceError
    from radixserve.model.loader import resolve_device

    try:
        resolve_device(value)
    except DeviceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value
