"""argparse value types: each parses one flag's text or raises argparse.ArgumentTypeError,
which argparse turns into `radixserve CMD: error: argument --flag: <message>` (exit 2)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from radixserve.values import MAX_BLOCK_SIZE, device_name, kv_cache_dtype_name, parse_size


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
whole_number = _int
number = _float


def kv_cache_dtype(text: str) -> str:
    """auto | float32 | bfloat16 | float16 (bf16, fp16 and fp32 are accepted as aliases)."""
    try:
        return kv_cache_dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device(text: str) -> str:
    """auto | cpu | cuda | cuda:N (spelling only: whether CUDA is there is checked before the
    model loads, by radixserve.preflight)."""
    try:
        return device_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def json_value(text: str) -> Any:
    """A JSON document given on the command line."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {e}") from None
