"""Decoder configuration, read from a Hugging Face config.json: the shapes, and every way the
architectures radixserve serves differ, stated as fields (one model definition reads them)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.errors import ModelNotFoundError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
)
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types values
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate activation: SwiGLU or GeGLU (tanh GELU)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder, with the per-architecture differences as data.

    Every architecture is the same pre-norm decoder: RMSNorm, attention over RoPE'd q/k, a
    gated MLP. What varies is which of these optional parts a layer has and their constants.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    architecture: str = "LlamaForCausalLM"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections with a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # Added to every RMSNorm weight at load: Gemma's norms scale by (1 + w).
    norm_weight_offset: float = 0.0
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
    hidden_act: str = "silu"  # one of ACTIVATIONS
    # RMSNorms on attention's and the MLP's outputs before each residual add (Gemma 3).
    sandwich_norms: bool = False
    attn_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim)
    sliding_window: int | None = None  # keys a windowed layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # FULL / SLIDING per layer; () with a window: all SLIDING
    local_rope_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None: shared
    fused_checkpoint: bool = False  # q/k/v and gate/up stored fused (Phi-3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i, or None where it attends to the whole context."""
        if self.sliding_window is None:
            return None
        if not self.layer_types or self.layer_types[i] == SLIDING:
            return self.sliding_window
        return None

    def layer_local_rope(self, i: int) -> bool:
        """Whether layer i rotates q/k by the local RoPE tables (a sliding layer of a model
        with its own local base)."""
        return self.local_rope_theta is not None and self.layer_window(i) is not None

    def num_parameters(self) -> int:
        """How many weights the decoder holds (embedding, layers, final norm, untied head)."""
        h, d = self.hidden_size, self.head_dim
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        layer = qkv * h + self.num_heads * d * h + 3 * h * self.intermediate_size
        layer += qkv * int(self.attention_bias) + 2 * d * int(self.qk_norm)
        layer += h * (2 + 2 * int(self.sandwich_norms))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    @property
    def softmax_scale(self) -> float:
        """The attention softmax scale."""
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the fields of a transformers config.json. Raises ModelNotFoundError
        naming an architecture or a variant of one that radixserve does not serve."""
        archs = [str(a) for a in d.get("architectures") or ["LlamaForCausalLM"]]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelNotFoundError(
                f"architecture {', '.join(archs)} is not supported; radixserve serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
        global_rope, local_rope = _rope(d, arch)
        layers = int(d["num_hidden_layers"])
        window = d.get("sliding_window")
        layer_types = d.get("layer_types") or ()
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            if not d.get("use_sliding_window"):
                window = None  # Qwen configs name a window they do not use unless asked to
            elif not layer_types:  # as transformers derives them
                first = int(d.get("max_window_layers", 0))
                layer_types = [SLIDING if i >= first else FULL for i in range(layers)]
        fields: dict[str, Any] = dict(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            architecture=arch,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(global_rope.get("rope_theta", 10000.0)),
            rope_scaling=_scaling(global_rope),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            sliding_window=int(window) if window else None,
            layer_types=tuple(str(t) for t in layer_types),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if arch == "Qwen3ForCausalLM":
            fields["qk_norm"] = True
        if arch == "Phi3ForCausalLM":
            fields["fused_checkpoint"] = True
        if arch == "Gemma3ForCausalLM":
            fields.update(_gemma3(d, hidden, local_rope))
        if fields["layer_types"] and len(fields["layer_types"]) != fields["num_layers"]:
            raise ModelNotFoundError("config.json: layer_types must name every layer")
        unknown = set(fields["layer_types"]) - {FULL, SLIDING}
        if unknown:
            raise ModelNotFoundError(f"config.json: unknown layer types {sorted(unknown)}")
        return cls(**fields)

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


def _rope(d: dict[str, Any], arch: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(RoPE parameters of full-attention layers, those of sliding layers or None), from the
    older fields (rope_theta, rope_scaling) or transformers 5's rope_parameters, which Gemma 3
    keys by layer type."""
    params = d.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full = dict(params.get(FULL) or {})
        local = dict(params[SLIDING]) if params.get(SLIDING) else None
    else:
        full, local = dict(params), None
    if d.get("rope_theta") is not None:
        full["rope_theta"] = d["rope_theta"]
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    if d.get("rope_local_base_freq") is not None:
        local = {"rope_theta": d["rope_local_base_freq"], "rope_type": "default"}
    factor = full.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if factor is not None and float(factor) != 1.0:
        raise ModelNotFoundError(
            f"{arch} with partial_rotary_factor {factor} is not supported (RoPE over whole heads)"
        )
    return full, local


def _scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling of `rope` (None for plain RoPE), or ModelNotFoundError for a kind we do
    not compute exactly."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3"):
        raise ModelNotFoundError(
            f"RoPE scaling {kind!r} is not supported (radixserve computes linear and llama3)"
        )
    return {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}


def _gemma3(d: dict[str, Any], hidden: int, local: dict[str, Any] | None) -> dict[str, Any]:
    """The Gemma 3 text model's fields beyond the shapes."""
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(cap) is not None:
            raise ModelNotFoundError(f"Gemma 3 with {cap} is not supported")
    if d.get("use_bidirectional_attention"):
        raise ModelNotFoundError("Gemma 3 with bidirectional attention is not supported")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelNotFoundError(f"Gemma 3 with activation {act!r} is not supported")
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if not types:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    if local is not None and _scaling(local) is not None:
        raise ModelNotFoundError("Gemma 3 with scaled RoPE on its sliding layers is not supported")
    scalar = float(d.get("query_pre_attn_scalar") or 256)
    return dict(
        qk_norm=True,
        norm_weight_offset=1.0,
        embed_scale=hidden**0.5,  # as transformers computes it
        hidden_act="gelu_tanh",
        sandwich_norms=True,
        attn_scale=scalar**-0.5,
        layer_types=tuple(types),
        local_rope_theta=float(local["rope_theta"]) if local else 10000.0,
        sliding_window=int(d.get("sliding_window") or 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
    )
