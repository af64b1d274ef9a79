"""Tiny GGUF files of every architecture radixserve reads, written as llama.cpp's converter
lays them out (tensor names, q/k rows in RoPE order for llama, Gemma's norms stored as 1 + w,
Phi-3's fused tensors), with matrices in the block types a test names: quantized from the
weights where the gguf package can, else random blocks with sane scales."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# Per architecture: the GGUF architecture name, whether q/k rows are permuted, the norm shift.
GGUF_LAYOUT = {
    "llama": ("llama", True, 0.0),
    "mistral": ("llama", True, 0.0),  # llama.cpp writes Mistral models as llama
    "qwen2": ("qwen2", False, 0.0),
    "qwen3": ("qwen3", False, 0.0),
    "phi3": ("phi3", False, 0.0),
    "gemma3": ("gemma3", False, 1.0),
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str, arch: str) -> str:
    if hf.startswith("model.embed_tokens"):
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    if module == "post_attention_layernorm":
        base = "post_attention_norm" if arch == "gemma3" else "ffn_norm"
    elif module == "pre_feedforward_layernorm":
        base = "ffn_norm"
    elif module == "post_feedforward_layernorm":
        base = "post_ffw_norm"
    else:
        base = _LAYER[module]
    return f"blk.{layer}.{base}.{suffix}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's RoPE row order for q/k (what radixserve's reader undoes)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _blocks(w: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """`w` [rows, cols] as `type_name` blocks: quantized where gguf can, else random blocks."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    try:
        return np.asarray(gguf.quants.quantize(w.astype(np.float32), qtype))
    except NotImplementedError:
        pass
    weights, nbytes = gguf.quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // weights, nbytes), dtype=np.uint8)
    fields = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,),
              "IQ3_XXS": (0,), "IQ3_S": (0,)}[type_name]  # fmt: skip
    for at in fields:
        scale = rng.uniform(0.0005, 0.004, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., at : at + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(w.shape[0], -1)


def write_tiny_gguf(
    path: Path,
    arch: str,
    hf: Any,
    types: dict[str, str],
    window: int | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write transformers model `hf` of architecture `arch` as a GGUF at `path`: matrices whose
    GGUF base name (attn_q, ffn_down, token_embd, ...) is in `types` in that block type
    (the rest float32), a SentencePiece-style vocabulary of the words w0, w1, .... With
    `chat_template`, the file carries it as tokenizer.chat_template and token 3 is Gemma's
    `<end_of_turn>` control token, as a chat model's file has them."""
    import gguf

    name, permuted, shift = GGUF_LAYOUT[arch]
    c = hf.config
    writer = gguf.GGUFWriter(str(path), name)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    theta = (c.rope_parameters.get("full_attention") or c.rope_parameters)["rope_theta"]
    writer.add_rope_freq_base(float(theta))
    if arch in ("gemma3", "qwen3"):
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if window is not None:
        writer.add_sliding_window(window)
    vocab = [f"w{i}" for i in range(c.vocab_size)]
    vocab[:3] = ["<unk>", "<s>", "</s>"]
    kinds = [2, 3, 3] + [1] * (c.vocab_size - 3)  # unknown, control, control, normal ...
    if chat_template is not None:
        vocab[3], kinds[3] = "<end_of_turn>", 3
        writer.add_chat_template(chat_template)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([-float(i) for i in range(c.vocab_size)])
    writer.add_token_types(kinds)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    rng = np.random.default_rng(0)
    for hf_name, t in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = t.detach().float().numpy()
        gname = _gguf_name(hf_name, arch)
        if permuted and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in gname else c.num_key_value_heads
            w = _permute(w, heads)
        if shift and gname.endswith("norm.weight"):
            w = w + np.float32(shift)
        base = gname.rsplit(".", 2)[-2]
        if w.ndim == 2 and base in types:
            qtype = gguf.GGMLQuantizationType[types[base]]
            writer.add_tensor(gname, _blocks(w, types[base], rng), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
