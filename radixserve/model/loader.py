"""Load a model's weights: pick its device, dtype and quantization, read the safetensors or
the GGUF, quantize and pack what a step reads (the files come from radixserve.model.files)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from radixserve.errors import DeviceError, ModelNotFoundError
from radixserve.model import kernels
from radixserve.model.config import ModelConfig
from radixserve.model.decoder import DecoderModel
from radixserve.model.files import ModelFiles
from radixserve.model.hugepages import (
    WeightArena,
    return_freed_memory_at_once,
    reuse_freed_memory,
)
from radixserve.model.kernels import matrix
from radixserve.model.kernels.matrix import PrefillPath
from radixserve.model.quant import QuantizedWeight
from radixserve.model.weights import (
    coded_parameters,
    load_hf_weights,
    pack_model_weights,
    quantize_model,
    use_stored_embedding,
)
from radixserve.values import QUANTIZATIONS, kv_cache_dtype_name

log = logging.getLogger(__name__)


def load_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files in `path`, cast to `dtype`."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} holds no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            out[k] = v.to(dtype) if v.is_floating_point() else v
    return out


def resolve_dtype(dtype: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """float32 | bfloat16 | float16 | auto.

    `auto` on a CPU is float32 when the weights are `quantized` (int4/int8) and our CPU
    kernels load: they run such models with float32 activations, paged attention and the
    one-call decode step, which decoded 2.2x faster than the bfloat16 path on an AVX-512
    bf16 CPU. Otherwise `auto` is bfloat16 where the hardware computes it fast.
    Raises DeviceError for a dtype the device cannot compute in.
    """
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if quantized:
            if kernels.load():
                return torch.float32
        return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32
    if dtype not in table:
        raise DeviceError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or auto")
    bf16_ok = device.type != "cuda" or torch.cuda.is_bf16_supported()
    problem = dtype_problem(dtype, device, bf16_ok)
    if problem:
        raise DeviceError(problem)
    return table[dtype]


def resolve_prefill_path(
    dtype_name: str, dtype: torch.dtype, device: torch.device, quantization: str
) -> PrefillPath:
    """Where prefill chunks' matmuls and attention run (kernels/matrix.py). `--dtype auto`
    on a CPU that runs a quantized model in float32: the fastest path the CPU has (AMX tiles
    in bfloat16 where Linux grants them, else int8 activations on AVX-512 VNNI, else, for a
    GGUF's blocks, int8 activations through AVX2; $RADIXSERVE_PREFILL_PATH may pick another).
    Everything else, `--dtype float32` included, is fp32: float32 from end to end."""
    if dtype_name != "auto" or device.type != "cpu" or dtype != torch.float32:
        return PrefillPath.FP32
    if quantization == "none" or not kernels.load():
        return PrefillPath.FP32
    path = matrix.default_path()
    if path.stored_blocks and quantization != "gguf":  # it computes GGUF blocks only
        return PrefillPath.FP32
    return path


def resolve_kv_cache_dtype(
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    *,
    dtype_name: str = "auto",
    device: torch.device | None = None,
    quantization: str = "none",
    prefill_path: PrefillPath = PrefillPath.FP32,
) -> torch.dtype:
    """The KV pool's element type: float32, bfloat16 or float16 (aliases bf16, fp16, fp32)
    store K/V so. `auto` is the model dtype (as vLLM's), except where `--dtype auto`
    (`dtype_name`) runs a model with quantized projections in float32 on the CPU, a GGUF's
    default: there 16 bits, half float32's bytes, as llama.cpp's f16 K/V. bfloat16 where
    `prefill_path`'s attention rounds K and V to bfloat16 anyway (the int8-vnni and bfloat16
    paths: nothing it reads changes), float16 elsewhere (finer: 10 bits of mantissa to 7).
    Quality of each: docs/cpu.md. `--dtype float32` stays float32 from end to end. Raises
    ValueError for anything else."""
    try:
        name = kv_cache_dtype_name(kv_cache_dtype)
    except ValueError as e:
        raise ValueError(f"--kv-cache-dtype {e}") from None
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name != "auto":
        return table[name]
    on_cpu = device is not None and device.type == "cpu"
    if dtype_name == "auto" and on_cpu and quantization != "none" and model_dtype == torch.float32:
        return torch.bfloat16 if prefill_path.attention_unit else torch.float16
    return model_dtype


def dtype_problem(dtype: str, device: torch.device, bf16_supported: bool) -> str | None:
    """Why `device` cannot run `dtype`, or None when it can (CPUs run all three)."""
    if dtype == "bfloat16" and device.type == "cuda" and not bf16_supported:
        return (
            f"--dtype bfloat16: {device} has no bfloat16 support (it needs compute capability "
            "8.0+); use --dtype float16 or float32"
        )
    return None


def _cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    """auto | cpu | cuda[:N]; auto picks CUDA when available. DeviceError if it is not here."""
    device = device.strip().lower()
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise DeviceError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        why = (
            f"this torch {torch.__version__} is built without CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible"
        )
        raise DeviceError(f"CUDA is not available for device {device!r} ({why}); use cpu")
    count = torch.cuda.device_count()
    if device != "cuda" and int(device[5:]) >= count:
        raise DeviceError(f"no CUDA device {device!r} ({count} visible: cuda:0..cuda:{count - 1})")
    return torch.device(device)


def resolve_quantization(quantization: str | None, files: ModelFiles, device: torch.device) -> str:
    """none | int8 | int4 | gguf; None (the default) is "gguf" for a GGUF file where our
    kernels run its blocks as stored (CPU), "none" otherwise, as vLLM serves a checkpoint's
    own format. ValueError for "gguf" without a GGUF file or our CPU kernels."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {QUANTIZATIONS}")
    kernels_run = device.type == "cpu" and kernels.load()
    if quantization == "gguf":
        if files.gguf is None:
            raise ValueError("--quantization gguf needs a .gguf model file")
        if not kernels_run:
            raise ValueError(
                "--quantization gguf runs on the CPU with radixserve's kernels; "
                "use --quantization none here"
            )
    if quantization is not None:
        return quantization
    if files.gguf is not None and kernels_run:
        return "gguf"
    return "none"


def load_memory(
    files: ModelFiles, config: ModelConfig, dtype: torch.dtype, quantization: str
) -> tuple[int, str]:
    """(bytes, what) the most that loading `files` holds at once: a GGUF served as stored
    (`quantization` "gguf") holds its matrices' codes once (`GgufWeights.resident_bytes`);
    otherwise the checkpoint's tensors and the model's parameters are both held."""
    if files.gguf is not None and quantization == "gguf":
        from radixserve.model.gguf_quant import GgufWeights  # needs gguf

        blocks = GgufWeights(files.gguf, files.path, config.num_heads, config.num_kv_heads)
        return blocks.resident_bytes(), f"{files.gguf.name}, its blocks as stored"
    n = config.num_parameters()
    name = str(dtype).removeprefix("torch.")
    return 2 * n * dtype.itemsize, f"{n / 1e9:.2f}B weights in {name}"


def load_model(
    files: ModelFiles,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = "none",
    prefill_path: PrefillPath = PrefillPath.FP32,
    max_model_len: int | None = None,
) -> DecoderModel:
    """Build the DecoderModel for `files` with its weights, on `device` in `dtype`, with its
    projections quantized as `resolve_quantization` decides and prefill on `prefill_path`
    (`resolve_prefill_path`; logged), for contexts of up to `max_model_len` tokens (the
    model's own maximum when None).

    A GGUF's weights are read from the file one tensor at a time. With quantization "gguf"
    its quantized matrices (the embedding table included) are used as stored, or repacked
    into the same values in the kernels' layout, and no float32 copy of them is made; on
    the CPU they are written straight onto the huge pages the step reads them from."""
    config = ModelConfig.from_dir(files.path)
    kind = resolve_quantization(quantization, files, device)
    return_freed_memory_at_once()
    model = DecoderModel(config, dtype, max_model_len)
    stored: Mapping[str, QuantizedWeight] = {}
    arena: WeightArena | None = None  # where the codes are written, if not packed after
    if files.gguf is None:
        load_hf_weights(model, load_state_dict(files.path, dtype))
    else:
        from radixserve.model.gguf_quant import GgufWeights  # needs gguf

        blocks = GgufWeights(files.gguf, files.path, config.num_heads, config.num_kv_heads)
        blocks.warn_unserved()
        stored = blocks
        if kind == "gguf" and device.type == "cpu":
            arena = WeightArena(blocks.coded_bytes())
        coded = coded_parameters(config, blocks) if kind == "gguf" else frozenset()
        load_hf_weights(model, blocks.dense_tensors(), skip=coded)
    model = model.to(device).eval()
    model.prepare()
    if kind != "none":
        kernels.load()
        k_quants = not prefill_path.stored_blocks
        panels = prefill_path if device.type == "cpu" else None  # K-quants straight to panels
        quantize_model(model, kind, stored, k_quants, arena=arena, path=panels)
        use_stored_embedding(model, stored)
    # Before packing; int8-vnni's panels over the codes in the arena (nothing else reads them).
    model.use_prefill_path(prefill_path, in_place=arena is not None)
    pack_model_weights(model, arena)
    return_freed_memory_at_once()
    # The load's temporaries are gone: a step's are reused from here, the large ones kept by
    # our allocator (glibc's heap fragments under them), the rest in glibc's heap.
    if device.type == "cpu":
        kernels.keep_step_buffers()
    reuse_freed_memory()
    log.info("%s", matrix.describe(prefill_path))
    return model
