"""Describe a GGUF file (llama, mistral, qwen2, qwen3, phi3, gemma3; gguf_arch.py) as a small
Hugging Face directory beside the file: config.json from the metadata, the tokenizer (and chat
template) transformers reads from the file, and an index of the file's tensors. The weights stay
in the GGUF, read from it at every start (model/gguf_quant.py). `export_hf` writes them out as
float32 safetensors too, for tools that want a full Hugging Face directory (transformers, vLLM)."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixserve.errors import ModelNotFoundError
from radixserve.model.gguf_arch import TENSOR_INDEX, GgufArch, gguf_arch, hf_config
from radixserve.model.gguf_header import GgufHeader, read_gguf_header
from radixserve.model.locks import file_lock

log = logging.getLogger(__name__)


def open_gguf(gguf_path: Path) -> GgufHeader:
    """The file's metadata and tensor table; ModelNotFoundError, in one line, for a file that
    is not a complete GGUF (truncated, corrupt, or another format)."""
    try:
        return read_gguf_header(gguf_path)
    except Exception as e:  # ValueError, struct.error, IndexError, OSError... on bad files
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(
            f"{gguf_path} is not a readable GGUF file (truncated or corrupt?): {why}"
        ) from e


def write_model_dir_once(gguf_path: Path, out_dir: Path) -> bool:
    """Write `gguf_path`'s config, tokenizer and tensor index into `out_dir` unless it is
    there; True if this call wrote it (`_once`)."""
    return _once(out_dir, lambda tmp: write_model_dir(gguf_path, tmp), gguf_path.name)


def export_hf_once(gguf_path: Path, out_dir: Path) -> bool:
    """`export_hf` into `out_dir` unless it is there; True if this call wrote it (`_once`)."""
    return _once(out_dir, lambda tmp: export_hf(gguf_path, tmp), gguf_path.name)


def _once(out_dir: Path, write: Callable[[Path], None], source: str) -> bool:
    """`write` a fresh `out_dir` (atomically) unless it holds a config.json; True if this call
    wrote it. Processes writing the same directory at once take turns on `out_dir`.lock: the
    first writes, the others wait for it and then find `out_dir` complete."""
    lock = out_dir.with_name(out_dir.name + ".lock")
    with file_lock(lock, f"waiting for another process reading {source}"):
        if (out_dir / "config.json").is_file():
            return False
        for stale in out_dir.parent.glob(_temp_prefix(out_dir) + "*"):  # a killed run's
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.perf_counter()
        log.info("writing %s from %s (once)", out_dir, source)
        _write_atomically(out_dir, write)
        log.info("wrote %s from %s in %.1fs", out_dir, source, time.perf_counter() - t0)
        return True


def _temp_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.convert-"


def _write_atomically(out_dir: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a fresh temporary directory beside `out_dir`, then rename it there."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out_dir), dir=out_dir.parent))
    try:
        write(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_model_dir(gguf_path: Path, out_dir: Path) -> None:
    """config.json, the tokenizer files and TENSOR_INDEX of `gguf_path` into `out_dir`.
    Raises ModelNotFoundError for an unreadable file, an architecture radixserve does not
    serve, or missing metadata."""
    header = open_gguf(gguf_path)
    name, arch = gguf_arch(header.metadata, gguf_path.name)
    (out_dir / "config.json").write_text(json.dumps(_config(header, gguf_path), indent=2))
    index = [
        dict(name=t.name, type=t.type, shape=list(t.shape), offset=t.offset, bytes=t.nbytes)
        for t in header.tensors
    ]
    (out_dir / TENSOR_INDEX).write_text(json.dumps({"architecture": name, "tensors": index}))
    log.info("%s: GGUF architecture %s as %s", gguf_path.name, name, arch.hf_architecture)
    log.info("building the tokenizer from the GGUF metadata (the slowest step)")
    _save_tokenizer(gguf_path, out_dir, arch, header.metadata.get("tokenizer.chat_template"))


def _config(header: GgufHeader, gguf_path: Path) -> dict[str, Any]:
    tensor_names = {t.name for t in header.tensors}
    embed = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelNotFoundError(f"{gguf_path.name} has no token_embd.weight tensor")
    return hf_config(header.metadata, gguf_path.name, tensor_names, int(embed.shape[-1]))


def export_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write `gguf_path` into the existing directory `out_dir` as a complete Hugging Face
    directory: its weights dequantized into float32 safetensors (as `GgufWeights.dense` reads
    them), config.json and the tokenizer. What transformers or vLLM load; radixserve itself
    serves the GGUF as it is."""
    from safetensors.torch import save_file

    from radixserve.model.gguf_quant import GgufWeights

    write_model_dir(gguf_path, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weights = GgufWeights(gguf_path, out_dir, heads, kv_heads)
    log.info("dequantising %s into float32 safetensors", gguf_path.name)
    tensors = dict(weights.dense_tensors())
    (out_dir / TENSOR_INDEX).unlink()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _save_tokenizer(
    gguf_path: Path, out_dir: Path, arch: GgufArch, chat_template: str | None
) -> None:
    """The tokenizer transformers builds from the file's metadata, with the file's chat
    template (tokenizer.chat_template) where it has one. The class is the one AutoTokenizer
    picks for the model type (TokenizersBackend where transformers names none), asked
    directly: AutoTokenizer would first build the model's config from the file with gguf's
    reader (about 5 s for a 49k vocabulary) only to learn that type, which config.json has."""
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    name = TOKENIZER_MAPPING_NAMES.get(arch.model_type) or "TokenizersBackend"
    cls = tokenizer_class_from_name(name)
    if cls is None:
        raise ModelNotFoundError(f"{gguf_path.name}: transformers lacks the tokenizer {name}")
    try:
        tok = cls.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises many kinds on tokenizers it cannot build
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(f"{gguf_path.name}: cannot build its tokenizer: {why}") from e
    if chat_template and not getattr(tok, "chat_template", None):
        tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))


if __name__ == "__main__":  # python -m radixserve.model.gguf_convert MODEL.gguf OUT_DIR
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(sys.argv) != 3:
        sys.exit("usage: python -m radixserve.model.gguf_convert MODEL.gguf OUT_DIR")
    export_hf_once(Path(sys.argv[1]), Path(sys.argv[2]))
