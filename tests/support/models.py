"""Tiny random Llama models: in memory (ours and its transformers twin) or written as a model
directory that `--model` accepts, so servers and commands start and answer in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from radixserve.model.config import ModelConfig
from radixserve.model.llama import LlamaModel
from radixserve.model.weights import load_hf_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_pair(seed: int = 0, **overrides: Any) -> tuple[Any, LlamaModel]:
    """A random transformers LlamaForCausalLM (2 layers, vocabulary 101 unless overridden)
    and a radixserve LlamaModel with the same weights, both in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw: dict[str, Any] = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(**kw)
    hf = LlamaForCausalLM(hf_cfg).eval()
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    ours = LlamaModel(cfg, torch.float32)
    load_hf_weights(ours, hf.state_dict())
    return hf, ours.eval()


def write_tiny_model(out: Path, tokenizer_from: Path | None = None, **config: Any) -> Path:
    """Write a Hugging Face model directory at `out` (created) and return it: the random
    weights and config of `build_tiny_pair(**config)`, and a tokenizer.

    With `tokenizer_from` (a model directory, e.g. the default model's) its tokenizer and chat
    template are copied, so `vocab_size` should be that tokenizer's; without it, a word-level
    tokenizer of the words "w0" ... "w{vocab_size - 1}" is written (no chat template).
    """
    hf, _ = build_tiny_pair(**config)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copy(tokenizer_from / name, out / name)
    else:
        _write_word_level_tokenizer(out, hf.config.vocab_size)
    return out


def _write_word_level_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(out)
