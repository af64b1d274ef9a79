"""Llama-family model configuration, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.errors import ModelNotFoundError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the fields of a transformers config.json."""
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ModelNotFoundError(
                f"architecture {', '.join(map(str, archs))} is not supported; radixserve serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        rope_params = d.get("rope_parameters") or {}
        theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = rope_params
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", "Qwen2ForCausalLM" in archs)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `path`/config.json."""
        f = Path(path) / "config.json"
        if not f.is_file():
            raise ModelNotFoundError(f"{path} has no config.json")
        try:
            d = json.loads(f.read_text())
        except ValueError as e:
            raise ModelNotFoundError(f"{f} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ModelNotFoundError(f"{f} is not a JSON object")
        try:
            return cls.from_hf_dict(d)
        except KeyError as e:
            raise ModelNotFoundError(f"{f} lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelNotFoundError(f"{f} has a field of the wrong type: {e}") from None
