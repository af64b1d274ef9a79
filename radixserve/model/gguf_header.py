"""A GGUF file's metadata and tensor table, read in one pass without touching the weights.

gguf's GGUFReader builds a numpy view for every part of every field, which for a 49k-token
vocabulary takes about 3 s on a 2-core machine; this walks the same layout (GGUF v2 / v3:
header, key-value pairs, tensor infos) with struct in a tenth of that. Sizes of the block
types come from the gguf package's table, so a type it does not know is unreadable here too."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

# Fixed-size value types of the metadata: GGUF type number -> numpy dtype.
_FIXED = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
    10: "<u8", 11: "<i8", 12: "<f8",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, where general.alignment is absent


class GgufTensorInfo(NamedTuple):
    """One tensor of the file: dims as stored (fastest-moving first, as gguf's reader gives
    them), its GGML type, where its data starts in the file and how many bytes it takes."""

    name: str
    shape: tuple[int, ...]
    type: int
    offset: int
    nbytes: int


class GgufHeader(NamedTuple):
    """The metadata (scalars as Python values, strings as str, arrays as lists) and tensors."""

    metadata: dict[str, Any]
    tensors: list[GgufTensorInfo]


def read_gguf_header(path: Path) -> GgufHeader:
    """Parse `path`'s metadata and tensor table. ValueError for a file that is not a GGUF,
    of a version other than 2 or 3, or that ends before its header or its tensors' data does
    (OSError where it cannot be read)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            return _Parser(m).header()
        except (struct.error, KeyError) as e:  # KeyError: a GGML type gguf does not know
            raise ValueError(f"not a complete GGUF header: {e}") from e


class _Parser:
    """A cursor over the mapped file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def header(self) -> GgufHeader:
        if self.buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic at the start of the file")
        self.pos = 4
        version, n_tensors, n_fields = self.unpack("<IQQ")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (readable: 2, 3)")
        metadata: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self.string()
            metadata[key] = self.value(*self.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            (dims,) = self.unpack("<I")
            shape = self.unpack(f"<{dims}Q")
            kind, offset = self.unpack("<IQ")
            infos.append((name, tuple(int(d) for d in shape), int(kind), int(offset)))
        align = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data = -(-self.pos // align) * align
        tensors = [_tensor(name, shape, kind, data + offset) for name, shape, kind, offset in infos]
        end = max((t.offset + t.nbytes for t in tensors), default=data)
        if end > len(self.buf):
            raise ValueError(f"the file ends at byte {len(self.buf)}, its tensors at {end}")
        return GgufHeader(metadata, tensors)

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = self.buf[self.pos : end].decode("utf-8", "replace")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _FIXED:
            return self.fixed(kind, 1)[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"metadata value of unknown type {kind}")
        item, n = self.unpack("<IQ")
        if item in _FIXED:
            return self.fixed(item, n)
        return [self.value(item) for _ in range(n)]

    def fixed(self, kind: int, n: int) -> list[Any]:
        values = np.frombuffer(self.buf, dtype=_FIXED[kind], count=n, offset=self.pos)
        self.pos += values.nbytes
        return list(values.tolist())


def _tensor(name: str, shape: tuple[int, ...], kind: int, offset: int) -> GgufTensorInfo:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    elements = int(np.prod(shape, dtype=np.int64))
    return GgufTensorInfo(name, shape, kind, offset, elements // block * size)
