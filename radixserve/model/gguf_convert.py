"""Convert a GGUF file (llama, mistral, qwen2, qwen3, phi3, gemma3; gguf_arch.py) into a
Hugging Face directory: float32 safetensors with transformers' tensor names, config.json from
the metadata, and the tokenizer (and chat template) transformers reads from the file."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from radixserve.errors import ModelNotFoundError
from radixserve.model.gguf_arch import field_value, gguf_arch, hf_config, hf_name, rope_heads

log = logging.getLogger(__name__)
T = TypeVar("T")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of q/k projections (rows of any element type:
    floats, or the bytes of whole quantized blocks, which never straddle rows)."""
    rows = w.shape[0]
    out: np.ndarray = (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )
    return out


def open_gguf(gguf_path: Path) -> Any:
    """A gguf.GGUFReader over the file; ModelNotFoundError, in one line, for a file that is
    not a complete GGUF (truncated, corrupt, or another format)."""
    import gguf

    try:
        return gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # the reader raises ValueError, IndexError, OSError... on bad files
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(
            f"{gguf_path} is not a readable GGUF file (truncated or corrupt?): {why}"
        ) from e


@contextlib.contextmanager
def file_lock(path: Path, waiting_message: str) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if absent; never deleted, so every process
    locks the same inode). Logs `waiting_message` once when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s", waiting_message)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf_once(gguf_path: Path, out_dir: Path) -> bool:
    """Convert `gguf_path` into `out_dir` unless it is there; True if this call converted it.

    Processes converting the same file at once take turns on `out_dir`.lock: the first converts,
    the others wait for it and then find `out_dir` complete.
    """
    lock = out_dir.with_name(out_dir.name + ".lock")
    with file_lock(lock, f"waiting for another process converting {gguf_path.name}"):
        if (out_dir / "config.json").is_file():
            return False
        for stale in out_dir.parent.glob(_temp_prefix(out_dir) + "*"):  # a killed conversion's
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.perf_counter()
        log.info("converting %s into %s (once)", gguf_path, out_dir)
        convert_gguf(gguf_path, out_dir)
        log.info("converted %s in %.1fs", gguf_path.name, time.perf_counter() - t0)
        return True


def _temp_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.convert-"


def _progress(items: Sequence[T], desc: str) -> Iterator[T]:
    """Yield `items`: with a tqdm bar on a terminal, else with a log line at each quarter."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, unit="tensor", leave=False)
        return
    n, quarter = len(items), 1
    for i, item in enumerate(items, 1):
        yield item
        if i * 4 >= quarter * n:
            log.info("%s: %d/%d tensors", desc, i, n)
            while i * 4 >= quarter * n:
                quarter += 1


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise `gguf_path` into `out_dir` (written atomically: a temp dir, then rename).
    Raises ModelNotFoundError for an unreadable file, an architecture radixserve does not
    serve, missing metadata, or a tensor type gguf cannot dequantize."""
    import gguf
    from safetensors.numpy import save_file

    reader = open_gguf(gguf_path)
    name, arch = gguf_arch(reader, gguf_path.name)
    tensor_names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ModelNotFoundError(f"{gguf_path.name} has no token_embd.weight tensor")
    config = hf_config(reader, gguf_path.name, tensor_names, int(embed.shape[-1]))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for t in _progress(reader.tensors, f"dequantising {gguf_path.name}"):
        target = hf_name(t.name, arch)
        if target is None:
            continue
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as e:
            raise ModelNotFoundError(
                f"{gguf_path.name}: tensor {t.name} is {t.tensor_type.name}, a type gguf "
                f"cannot dequantize ({e})"
            ) from e
        n_head = rope_heads(t.name, arch, heads, kv_heads)
        if n_head is not None:
            w = unpermute(w, n_head)
        if arch.norm_shift and t.name.endswith("norm.weight"):
            w = w - np.float32(arch.norm_shift)  # transformers' convention: the norm is 1 + w
        tensors[target] = np.ascontiguousarray(w)
    log.info("%s: GGUF architecture %s as %s", gguf_path.name, name, arch.hf_architecture)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out_dir), dir=out_dir.parent))
    try:
        log.info("writing %d tensors as float32 safetensors", len(tensors))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        log.info("building the tokenizer from the GGUF metadata (the slowest step)")
        _save_tokenizer(gguf_path, tmp, field_value(reader, "tokenizer.chat_template"))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    """The tokenizer transformers builds from the file's metadata, with the file's chat
    template (tokenizer.chat_template) where it has one."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises many kinds on tokenizers it cannot build
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelNotFoundError(f"{gguf_path.name}: cannot build its tokenizer: {why}") from e
    if chat_template and not getattr(tok, "chat_template", None):
        tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))
