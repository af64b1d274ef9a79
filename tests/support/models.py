"""Tiny random decoders of every architecture radixserve serves: in memory (ours and its
transformers twin) or written as a model directory that `--model` accepts, so servers and
commands start and answer in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from radixserve.model.config import FULL, SLIDING, ModelConfig
from radixserve.model.decoder import DecoderModel
from radixserve.model.weights import load_hf_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# transformers' (config class, model class) of each architecture, by a short name.
TRANSFORMERS_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
ARCHITECTURES = tuple(TRANSFORMERS_CLASSES)
TINY_WINDOW = 8  # the sliding window of the tiny configs that have one: prompts pass it

# What makes each tiny config exercise its architecture's differences (beyond the shapes).
_TINY_EXTRAS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": TINY_WINDOW},  # every layer windowed
    # Qwen2's q/k/v bias; a window on the layers from max_window_layers on.
    "qwen2": {"use_sliding_window": True, "sliding_window": TINY_WINDOW, "max_window_layers": 1},
    "qwen3": {"head_dim": 24},  # q/k norms; heads wider than hidden / heads
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},  # fused qkv, gate_up
    "gemma3": {
        "head_dim": 16,
        "num_hidden_layers": 3,
        "layer_types": [SLIDING, FULL, SLIDING],
        "sliding_window": TINY_WINDOW,
        "query_pre_attn_scalar": 24,  # a softmax scale that is not 1/sqrt(head_dim)
        "rope_parameters": {
            FULL: {"rope_type": "default", "rope_theta": 1_000_000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "pad_token_id": 0,
    },
}


def build_tiny_pair(
    seed: int = 0, arch: str = "llama", **overrides: Any
) -> tuple[Any, DecoderModel]:
    """A random transformers model of architecture `arch` (one of ARCHITECTURES; 2 layers,
    vocabulary 101 unless overridden) and a radixserve DecoderModel with the same weights,
    both float32 in eval mode. Norm weights and biases are randomized too, so an offset or a
    missing bias would show."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in TRANSFORMERS_CLASSES[arch])
    kw: dict[str, Any] = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    if arch != "gemma3":
        kw["rope_theta"] = 10000.0
    kw.update(_TINY_EXTRAS[arch])
    kw.update(overrides)
    torch.manual_seed(seed)
    hf_cfg = config_cls(**kw)
    hf = model_cls(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict() | {"architectures": [model_cls.__name__]})
    ours = DecoderModel(cfg, torch.float32)
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
