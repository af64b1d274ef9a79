"""Convert a Llama GGUF file into a Hugging Face directory (fp32 safetensors + tokenizer)."""

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

log = logging.getLogger(__name__)
T = TypeVar("T")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of q/k projections."""
    rows, cols = w.shape
    out: np.ndarray = (
        w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    )
    return out


def hf_name(gguf_name: str) -> str:
    """The transformers parameter name of a GGUF tensor name."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


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
    """Dequantise `gguf_path` into `out_dir` (written atomically: a temp dir, then rename)."""
    import gguf
    from safetensors.numpy import save_file

    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:
        raise ModelNotFoundError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelNotFoundError(
            f"{gguf_path.name} holds a model of GGUF architecture {arch!r}, which radixserve does "
            "not serve: GGUF files must be 'llama' (Hugging Face directories may be Llama, "
            "Mistral or Qwen2)"
        )
    required = ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")
    for key in (f"llama.{k}" for k in required):
        if _field(reader, key) is None:
            raise ModelNotFoundError(f"{gguf_path.name} lacks the GGUF metadata field {key}")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    hidden = int(_field(reader, "llama.embedding_length"))
    tensors: dict[str, np.ndarray] = {}
    for t in _progress(reader.tensors, f"dequantising {gguf_path.name}"):
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, n_kv)
        tensors[hf_name(t.name)] = np.ascontiguousarray(w)
    tied = "lm_head.weight" not in tensors
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out_dir), dir=out_dir.parent))
    try:
        log.info("writing %d tensors as float32 safetensors", len(tensors))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        log.info("building the tokenizer from the GGUF metadata (the slowest step)")
        _save_tokenizer(gguf_path, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
