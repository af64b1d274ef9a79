"""Read a GGUF file's Q4_1 / Q8_0 matrices as QuantizedWeights, without dequantizing them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from radixserve.model.gguf_convert import _unpermute, hf_name
from radixserve.model.quant import GROUP, QuantizedWeight

# Bytes of one block of 32 weights: Q4_1 = f16 scale, f16 min, 16 bytes of nibbles;
# Q8_0 = f16 scale, 32 int8 codes.
_Q4_1_BYTES = 20
_Q8_0_BYTES = 34


def _rows(raw: np.ndarray, n_head: int | None) -> np.ndarray:
    # llama.cpp stores q/k rows permuted for its RoPE; blocks never straddle rows, so the
    # row permutation applies to the packed bytes as it does to the floats.
    return raw if n_head is None else _unpermute(raw, n_head)


def load_quantized_cached(
    gguf_path: Path, cache_file: Path, num_heads: int, num_kv_heads: int
) -> dict[str, QuantizedWeight]:
    """`read_quantized`, through a safetensors copy at `cache_file` (written on first use,
    atomically): parsing the GGUF's metadata takes ~5 s, reading the copy well under one."""
    if cache_file.exists():
        try:
            return load_quantized(cache_file)
        except Exception:  # a damaged copy: read the GGUF again and rewrite it
            pass
    weights = read_quantized(gguf_path, num_heads, num_kv_heads)
    try:
        save_quantized(weights, cache_file)
    except OSError:  # a read-only cache: fine, just slower next time
        pass
    return weights


def save_quantized(weights: dict[str, QuantizedWeight], path: Path) -> None:
    """Write `weights` as one safetensors file (`<name>.qs|scale|minv`), atomically."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        tensors[f"{name}.qs"] = w.qs
        tensors[f"{name}.scale"] = w.scale
        if w.minv is not None:
            tensors[f"{name}.minv"] = w.minv
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def load_quantized(path: Path) -> dict[str, QuantizedWeight]:
    """The weights `save_quantized` wrote (int4 codes are uint8, int8 codes int8)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    out: dict[str, QuantizedWeight] = {}
    for key, qs in tensors.items():
        if not key.endswith(".qs"):
            continue
        name = key.removesuffix(".qs")
        kind = "int4" if qs.dtype == torch.uint8 else "int8"
        out[name] = QuantizedWeight(kind, qs, tensors[name + ".scale"], tensors.get(name + ".minv"))
    return out


def read_quantized(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, QuantizedWeight]:
    """Every Q4_1 (as int4) and Q8_0 (as int8) matrix of the GGUF, by transformers name."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
            continue
        n_head = None
        if t.name.endswith("attn_q.weight"):
            n_head = num_heads
        elif t.name.endswith("attn_k.weight"):
            n_head = num_kv_heads
        raw = np.ascontiguousarray(_rows(np.asarray(t.data), n_head))
        rows = raw.shape[0]
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            blocks = raw.reshape(rows, -1, _Q4_1_BYTES)
            scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            minv = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[..., 4:].reshape(rows, -1)
            out[hf_name(t.name)] = QuantizedWeight(
                "int4",
                torch.from_numpy(np.ascontiguousarray(qs)),
                torch.from_numpy(np.ascontiguousarray(scale)),
                torch.from_numpy(np.ascontiguousarray(minv)),
            )
        else:
            blocks = raw.reshape(rows, -1, _Q8_0_BYTES)
            scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
            out[hf_name(t.name)] = QuantizedWeight(
                "int8",
                torch.from_numpy(np.ascontiguousarray(qs)),
                torch.from_numpy(np.ascontiguousarray(scale)),
                None,
            )
        assert out[hf_name(t.name)].shape[1] % GROUP == 0
    return out
