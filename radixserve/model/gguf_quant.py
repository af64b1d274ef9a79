"""Read a GGUF file's quantized matrices as QuantizedWeights, their blocks as the file stores
them (kind "gguf"), without dequantizing them; and keep a safetensors copy for fast starts."""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from radixserve.model.gguf_arch import gguf_arch, hf_name, rope_heads
from radixserve.model.gguf_convert import open_gguf, unpermute
from radixserve.model.quant import QuantizedWeight

log = logging.getLogger(__name__)

# The block types our kernels compute as they are (kernels/kquants.cpp), by GGML's names.
SERVED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_DENSE_TYPES = ("F32", "F16", "BF16")  # plain floats: dense weights, nothing lost


def load_quantized_cached(
    gguf_path: Path, cache_file: Path, num_heads: int, num_kv_heads: int
) -> dict[str, QuantizedWeight]:
    """`read_quantized`, through a safetensors copy at `cache_file` (written on first use,
    atomically): parsing the GGUF's metadata takes seconds, reading the copy well under one."""
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
    """Write `weights` as one safetensors file (`<name>.qs|scale|minv`, and for GGUF blocks
    `<name>.layout|cols`), atomically."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        tensors[f"{name}.qs"] = w.qs
        if w.kind == "gguf":
            assert w.layout is not None
            tensors[f"{name}.layout"] = w.layout
            tensors[f"{name}.cols"] = torch.tensor([w.cols], dtype=torch.int64)
            continue
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
        if name + ".layout" in tensors:
            cols = int(tensors[name + ".cols"][0])
            out[name] = gguf_weight(qs, tensors[name + ".layout"], cols)
            continue
        kind = "int4" if qs.dtype == torch.uint8 else "int8"
        out[name] = QuantizedWeight(kind, qs, tensors[name + ".scale"], tensors.get(name + ".minv"))
    return out


def gguf_weight(blocks: torch.Tensor, layout: torch.Tensor, cols: int) -> QuantizedWeight:
    """A QuantizedWeight of GGUF blocks: `blocks` uint8, `layout` [parts, 2] (rows, GGML type)."""
    empty = torch.empty(0, dtype=torch.float32)
    return QuantizedWeight("gguf", blocks.reshape(-1), empty, None, layout, cols)


def read_quantized(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, QuantizedWeight]:
    """Every matrix of the GGUF stored in a type of SERVED_TYPES, by transformers name, as
    GGUF blocks (q/k rows out of llama.cpp's RoPE order where it permuted them). Matrices of
    other quantized types are left to the dense weights, with a warning naming the types."""
    import gguf

    reader = open_gguf(path)
    _, arch = gguf_arch(reader, path.name)
    served = {gguf.GGMLQuantizationType[n] for n in SERVED_TYPES}
    dense = {gguf.GGMLQuantizationType[n] for n in _DENSE_TYPES}
    out: dict[str, QuantizedWeight] = {}
    unserved: Counter[str] = Counter()
    for t in reader.tensors:
        target = hf_name(t.name, arch)
        if target is None or t.tensor_type in dense or len(t.shape) != 2:
            continue
        if t.tensor_type not in served:
            unserved[t.tensor_type.name] += 1
            continue
        raw = np.asarray(t.data)  # [rows, bytes per row]
        n_head = rope_heads(t.name, arch, num_heads, num_kv_heads)
        if n_head is not None:
            raw = unpermute(raw, n_head)
        layout = torch.tensor([[raw.shape[0], int(t.tensor_type)]], dtype=torch.int64)
        blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).copy())
        out[target] = gguf_weight(blocks, layout, int(t.shape[0]))
    for name, count in unserved.items():
        log.warning(
            "%s: %d matrices are %s, which radixserve's kernels do not compute as stored "
            "(they take %s): those run on their float32 dequantization, slower",
            path.name, count, name, ", ".join(SERVED_TYPES),
        )  # fmt: skip
    return out
