"""A GGUF file's weights read straight from the file, one tensor at a time, by transformers
name: quantized matrices as QuantizedWeights of the file's own blocks (kind "gguf", never
dequantized; mapped from the file, not read), any tensor as float32 values. Nothing is copied
to disk and nothing is kept: the loader turns each matrix into what the kernels read and drops
the bytes it mapped or read."""

from __future__ import annotations

import json
import logging
import mmap
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from radixserve.errors import ModelNotFoundError
from radixserve.model.gguf_arch import GGUF_ARCHS, TENSOR_INDEX, hf_name, rope_heads, unpermute
from radixserve.model.quant import QuantizedWeight

log = logging.getLogger(__name__)

# The block types our kernels compute as they are (kernels/kquants.cpp), by GGML's names and
# numbers: the quantized ones and the 16-bit floats (F16, BF16: 2 bytes a weight, where
# float32 would double them).
SERVED_TYPES = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS",
    "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "F16", "BF16",
)  # fmt: skip
_SERVED = dict(
    zip((2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 22, 18, 21, 20, 23, 1, 30), SERVED_TYPES,
        strict=True)
)  # fmt: skip
# Bytes of codes after quant.repacked per byte as stored (int4: 16 + 8 bytes per 32 weights,
# int8: 32 + 4): Q4_0, Q4_1, Q5_0, Q8_0, Q4_K; Q6_K in the int8 paths' q6k-vnni panels (per 16 rows
# and 256 columns, 8 x 384 bytes of codes and 320 of factors against 16 blocks of 210).
_REPACK_GROWTH = {2: 24 / 18, 3: 24 / 20, 6: 36 / 22, 8: 36 / 34, 12: 192 / 144, 14: 3392 / 3360}
_DENSE_TYPES = {0: np.float32, 1: np.float16}  # F32, F16 (BF16, 30: below)
_BF16 = 30


class GgufTensor(NamedTuple):
    """Where one tensor lies in the file (TENSOR_INDEX's entry)."""

    name: str  # the GGUF name
    type: int  # GGML type number
    shape: tuple[int, ...]  # GGUF order: the row length first
    offset: int  # of its data from the file's start
    nbytes: int


class GgufWeights(Mapping[str, QuantizedWeight]):
    """The matrices of a GGUF file stored in a block type of SERVED_TYPES, by transformers
    name, each read from the file when asked for (q/k rows out of llama.cpp's RoPE order);
    `dense(name)` reads any tensor as float32. Matrices of other quantized types are left to
    the dense weights, with a warning naming the types."""

    def __init__(self, gguf_path: Path, model_dir: Path, num_heads: int, num_kv_heads: int):
        self.path = gguf_path
        try:
            index = json.loads((model_dir / TENSOR_INDEX).read_text())
            arch = GGUF_ARCHS[index["architecture"]]
            found = [GgufTensor(t["name"], t["type"], tuple(t["shape"]), t["offset"], t["bytes"])
                     for t in index["tensors"]]  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelNotFoundError(f"{model_dir / TENSOR_INDEX} is unreadable: {e}") from e
        self._heads = {t.name: rope_heads(t.name, arch, num_heads, num_kv_heads) for t in found}
        self._norm_shift = np.float32(arch.norm_shift)
        self.tensors: dict[str, GgufTensor] = {}
        for t in found:
            target = hf_name(t.name, arch)
            if target is not None:
                self.tensors[target] = t
        self._served = {
            name for name, t in self.tensors.items() if t.type in _SERVED and len(t.shape) == 2
        }

    def __getitem__(self, name: str) -> QuantizedWeight:
        if name not in self._served:
            raise KeyError(name)
        t = self.tensors[name]
        rows = t.shape[1]
        raw = self._mapped(t).reshape(rows, -1)
        n_head = self._heads[t.name]
        if n_head is not None:
            raw = np.ascontiguousarray(unpermute(raw, n_head))
        layout = torch.tensor([[rows, t.type]], dtype=torch.int64)
        return gguf_weight(torch.from_numpy(raw.reshape(-1)), layout, int(t.shape[0]))

    def __contains__(self, name: object) -> bool:
        return name in self._served

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._served))

    def __len__(self) -> int:
        return len(self._served)

    def dense(self, name: str) -> torch.Tensor:
        """Tensor `name` as float32 values as transformers holds them (dequantized, q/k rows
        out of RoPE order, norms without llama.cpp's added shift). KeyError if the file lacks
        it; ModelNotFoundError for a type the gguf package cannot dequantize."""
        t = self.tensors[name]
        raw = self._read(t)
        shape = tuple(reversed(t.shape))
        if t.type in _DENSE_TYPES:
            w = raw.view(_DENSE_TYPES[t.type]).astype(np.float32).reshape(shape)
        elif t.type == _BF16:
            w = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        else:
            w = _dequantize(raw.reshape(shape[0] if len(shape) > 1 else 1, -1), t, self.path)
            w = w.reshape(shape)
        n_head = self._heads[t.name]
        if n_head is not None:
            w = unpermute(w, n_head)
        if self._norm_shift and t.name.endswith("norm.weight"):
            w = w - self._norm_shift  # transformers' convention: the norm is 1 + w
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

    def warn_unserved(self) -> None:
        """Log, per GGML type, the matrices our kernels do not compute as stored."""
        unserved = Counter(
            t.type for t in self.tensors.values() if len(t.shape) == 2 and t.type not in _SERVED
        )
        for kind, count in unserved.items():
            if kind in _DENSE_TYPES or kind == _BF16:
                continue
            log.warning(
                "%s: %d matrices are of GGML type %d, which radixserve's kernels do not compute "
                "as stored (they take %s): those run on their float32 dequantization, slower",
                self.path.name, count, kind, ", ".join(SERVED_TYPES),
            )  # fmt: skip

    def resident_bytes(self) -> int:
        """About the most memory the model's weights take once loaded from this file: codes
        as stored, or repacked (at most `_REPACK_GROWTH` times the bytes), everything else
        as float32."""
        total = 0
        for name, t in self.tensors.items():
            if name in self._served:
                total += int(t.nbytes * _REPACK_GROWTH.get(t.type, 1.0))
            else:
                total += 4 * int(np.prod(t.shape))
        return total

    def coded_bytes(self) -> int:
        """At most the bytes the matrices served as stored take once repacked (and laid on
        64-byte boundaries)."""
        return sum(
            int(t.nbytes * _REPACK_GROWTH.get(t.type, 1.0)) + 3 * 64
            for name, t in self.tensors.items()
            if name in self._served
        )

    def dense_tensors(self) -> Mapping[str, torch.Tensor]:
        """Every tensor of the file by transformers name, as `dense` reads it (on access)."""
        return _DenseView(self)

    def _read(self, t: GgufTensor) -> np.ndarray:
        """The tensor's bytes, read into memory of their own."""
        out = np.empty(t.nbytes, dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(t.offset)
            if f.readinto(out.data) != t.nbytes:
                raise ModelNotFoundError(f"{self.path} ends inside tensor {t.name} (truncated?)")
        return out

    def _mapped(self, t: GgufTensor) -> np.ndarray:
        """The tensor's bytes mapped from the file, nothing copied (writes stay private):
        the loader reads each matrix once, to repack it or copy it where the kernels read it,
        and the mapping goes with the last array over it."""
        start = t.offset - t.offset % mmap.ALLOCATIONGRANULARITY
        try:
            with open(self.path, "rb") as f:
                m = mmap.mmap(f.fileno(), t.offset + t.nbytes - start, access=mmap.ACCESS_COPY,
                              offset=start)  # fmt: skip
        except ValueError as e:  # beyond the end of the file
            raise ModelNotFoundError(f"{self.path} ends inside tensor {t.name} (truncated?)") from e
        return np.frombuffer(m, dtype=np.uint8, count=t.nbytes, offset=t.offset - start)


class _DenseView(Mapping[str, torch.Tensor]):
    def __init__(self, weights: GgufWeights) -> None:
        self._weights = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._weights.dense(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights.tensors)

    def __len__(self) -> int:
        return len(self._weights.tensors)


def _dequantize(raw: np.ndarray, t: GgufTensor, path: Path) -> np.ndarray:
    import gguf

    try:
        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.type))
    except (NotImplementedError, ValueError) as e:
        raise ModelNotFoundError(
            f"{path.name}: tensor {t.name} is of GGML type {t.type}, which gguf cannot "
            f"dequantize ({e})"
        ) from e
    return np.asarray(w, dtype=np.float32)


def gguf_weight(blocks: torch.Tensor, layout: torch.Tensor, cols: int) -> QuantizedWeight:
    """A QuantizedWeight of GGUF blocks: `blocks` uint8, `layout` [parts, 2] (rows, GGML type)."""
    empty = torch.empty(0, dtype=torch.float32)
    return QuantizedWeight("gguf", blocks.reshape(-1), empty, None, layout, cols)
