"""What each GGUF architecture radixserve serves means in Hugging Face terms: the transformers
name of every tensor, whether llama.cpp stored q/k rows in its RoPE order or norms with 1
added, and the config.json its metadata stands for (llama, mistral, qwen2, qwen3, phi3,
gemma3). gguf_convert.py and gguf_quant.py read files through it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.errors import ModelNotFoundError

if TYPE_CHECKING:
    import numpy as np

# Per-layer tensor names every architecture shares (GGUF base name -> transformers module).
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


@dataclass(frozen=True)
class GgufArch:
    """One GGUF `general.architecture` as radixserve serves it."""

    hf_architecture: str  # the transformers class
    model_type: str  # config.json's model_type
    rope_permuted: bool = False  # llama.cpp stored attn_q / attn_k rows in its RoPE order
    norm_shift: float = 0.0  # llama.cpp's converter added this to every norm weight
    layer_names: dict[str, str] = field(default_factory=dict)  # this architecture's own


GGUF_ARCHS = {
    "llama": GgufArch("LlamaForCausalLM", "llama", rope_permuted=True),
    "mistral": GgufArch("MistralForCausalLM", "mistral", rope_permuted=True),
    "qwen2": GgufArch("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GgufArch(
        "Qwen3ForCausalLM",
        "qwen3",
        layer_names={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    ),
    # Phi-3 keeps q/k/v in one tensor and gate/up in one "ffn_up".
    "phi3": GgufArch(
        "Phi3ForCausalLM",
        "phi3",
        layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    ),
    "gemma3": GgufArch(
        "Gemma3ForCausalLM",
        "gemma3_text",
        norm_shift=1.0,
        layer_names={
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
    ),
}


# Control tokens that end a turn in the chat templates of these families; llama.cpp stops on
# them too (Gemma's <end_of_turn>, ChatML's <|im_end|>, Llama 3's <|eot_id|>, Phi-3's <|end|>).
END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")
_CONTROL = 3  # tokenizer.ggml.token_type of control tokens


def gguf_arch(meta: Mapping[str, Any], file_name: str) -> tuple[str, GgufArch]:
    """The file's architecture name (from its metadata `meta`) and its GgufArch;
    ModelNotFoundError naming an architecture radixserve does not serve."""
    name = meta.get("general.architecture")
    if name not in GGUF_ARCHS:
        raise ModelNotFoundError(
            f"{file_name} holds a model of GGUF architecture {name!r}, which radixserve does "
            f"not serve (GGUF architectures served: {', '.join(GGUF_ARCHS)})"
        )
    return str(name), GGUF_ARCHS[name]


def hf_name(gguf_name: str, arch: GgufArch) -> str | None:
    """The transformers parameter name of a GGUF tensor name (None for a tensor the model
    does not use, such as Llama 3's rope_freqs, handled from the metadata)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        module = arch.layer_names.get(kind) or _LAYER_NAMES.get(kind)
        return None if module is None else f"model.layers.{layer}.{module}.{suffix}"
    top = _TOP_NAMES.get(base)
    return None if top is None else f"{top}.{suffix}"


def rope_heads(gguf_name: str, arch: GgufArch, num_heads: int, num_kv_heads: int) -> int | None:
    """The head count whose RoPE row order llama.cpp gave this tensor (None: rows as in the
    transformers checkpoint)."""
    if not arch.rope_permuted:
        return None
    if gguf_name.endswith("attn_q.weight") or gguf_name.endswith("attn_q.bias"):
        return num_heads
    if gguf_name.endswith("attn_k.weight") or gguf_name.endswith("attn_k.bias"):
        return num_kv_heads
    return None


def stop_token_ids(meta: Mapping[str, Any]) -> int | list[int] | None:
    """The file's end-of-sequence token, with its end-of-turn ones (the eot / eom ids it names,
    and the END_OF_TURN control tokens of its vocabulary): a chat stops at either."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    found = [int(i) for i in ids if i is not None]
    tokens = meta.get("tokenizer.ggml.tokens")
    kinds = meta.get("tokenizer.ggml.token_type")
    if tokens is not None and kinds is not None:
        found += [i for i, k in enumerate(kinds) if k == _CONTROL and tokens[i] in END_OF_TURN]
    unique = list(dict.fromkeys(found))
    if not unique:
        return None
    return unique[0] if len(unique) == 1 else unique


def hf_config(
    meta: Mapping[str, Any], file_name: str, tensor_names: set[str], vocab: int
) -> dict[str, Any]:
    """The transformers config.json the file's metadata stands for. ModelNotFoundError for a
    missing field or a variant radixserve does not compute (long-context RoPE factors)."""
    name, arch = gguf_arch(meta, file_name)

    def need(key: str) -> Any:
        value = meta.get(f"{name}.{key}")
        if value is None:
            raise ModelNotFoundError(f"{file_name} lacks the GGUF metadata field {name}.{key}")
        return value

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{name}.{key}", default)

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    layers = int(need("block_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    for t in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        if t in tensor_names:
            raise ModelNotFoundError(
                f"{file_name} scales RoPE by per-frequency factors ({t}), which radixserve "
                "does not compute from a GGUF; serve the model's Hugging Face directory instead"
            )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1e4))}
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ModelNotFoundError(f"{file_name}: RoPE scaling {scaling!r} is not supported")
        rope = rope | {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    eos = stop_token_ids(meta)
    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
    }
    window = get("attention.sliding_window")
    if name == "gemma3":
        # As llama.cpp runs Gemma 3: every 6th layer global, the others on the window with a
        # RoPE base of 10,000; the softmax scale from the head size (27B: hidden / heads).
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(window or 4096),
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
            ],
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
            rope_parameters={
                "full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    else:
        config["hidden_act"] = "silu"
        config["rope_parameters"] = rope
        config["rope_theta"] = rope["rope_theta"]
        if window:
            config["sliding_window"] = int(window)
            config["use_sliding_window"] = True
    return config


# The file's tensors (name, GGML type, shape, offset, bytes) beside its config: reading them
# from the JSON takes milliseconds, gguf.GGUFReader seconds (it parses the whole vocabulary).
TENSOR_INDEX = "gguf_tensors.json"


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of q/k projections (rows of any element type:
    floats, or the bytes of whole quantized blocks, which never straddle rows)."""
    rows = w.shape[0]
    out: np.ndarray = (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )
    return out
