"""GGUF files of every architecture load and compute what transformers computes on the same
file (its own GGUF loading, float32): tiny random models written as llama.cpp lays them out,
their matrices in each block type radixserve keeps as stored, q/k/v of mixed types."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.batch import SeqChunk
from radixserve.model.config import ModelConfig
from radixserve.model.files import resolve_model
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner
from tests.support.gguf_files import write_tiny_gguf
from tests.support.steps import run_step

pytest.importorskip("gguf")

WINDOW = 8
# The block type of each matrix, per architecture: together every type radixserve serves
# (the 16-bit floats too), and q/k/v (fused into one matrix) of two types where llama.cpp's
# Q4_K_M mixes them.
TYPES = {
    "llama": dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="IQ4_XS",
                  ffn_gate="Q4_0", ffn_up="Q4_0", ffn_down="Q8_0", output="Q6_K"),
    "mistral": dict(attn_q="IQ4_NL", attn_k="IQ4_NL", attn_v="Q4_1", attn_output="F16",
                    ffn_gate="Q4_1", ffn_up="Q4_1", ffn_down="BF16", output="F16"),
    "qwen2": dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q8_0", attn_output="IQ2_XS",
                  ffn_gate="Q5_1", ffn_up="Q5_1", ffn_down="Q6_K", token_embd="Q8_0"),
    "qwen3": dict(attn_q="Q5_K", attn_k="Q5_K", attn_v="Q5_K", attn_output="Q4_K",
                  ffn_gate="Q2_K", ffn_up="Q2_K", ffn_down="Q6_K", token_embd="Q8_0"),
    "phi3": dict(attn_qkv="IQ3_XXS", attn_output="Q3_K", ffn_up="IQ2_XXS", ffn_down="Q4_K"),
    "gemma3": dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q8_0", attn_output="IQ2_S",
                   ffn_gate="IQ3_S", ffn_up="IQ3_S", ffn_down="Q6_K", token_embd="Q8_0"),
}  # fmt: skip
SHAPES = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=101,
)  # fmt: skip
EXTRA = {
    "llama": {},
    "mistral": {"sliding_window": None},  # a llama-arch GGUF has no window
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"head_dim": 128},  # transformers reads no head size from a qwen3 GGUF: 128
    "phi3": {},
    # head_dim 256: transformers' Gemma 3 default softmax scale, which llama.cpp (and
    # radixserve) take from the head size; every layer sliding, as pattern 6 makes 2 layers
    "gemma3": {"head_dim": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
               "tie_word_embeddings": True, "sliding_window": WINDOW,
               "layer_types": ["sliding_attention", "sliding_attention"],
               "num_hidden_layers": 2},
}  # fmt: skip


@pytest.mark.parametrize("arch", list(TYPES))
def test_gguf_logits_equal_transformers_loading_the_same_file(
    tiny_pair_factory, tmp_path: Path, arch: str
) -> None:
    from transformers import AutoModelForCausalLM

    hf, _ = tiny_pair_factory(arch=arch, **(SHAPES | EXTRA[arch]))
    window = WINDOW if arch == "gemma3" else None
    path = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, hf, TYPES[arch], window)
    files = resolve_model(str(path), cache_dir=tmp_path / "cache")
    model = load_model(files, torch.float32, torch.device("cpu"), None)
    assert model.quantization == "gguf"
    assert model.fused_decode_unavailable() is None  # every projection in our kernels
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = [(7 * i + 3) % 101 for i in range(3 * WINDOW + 5)]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    runner = ModelRunner(model, 32, 4, max_num_batched_tokens=64)
    table = list(range(12))
    got = [run_step(runner, [SeqChunk(ids[:-3], 0, table)], keep_logits=True)[0].logits]
    for i in range(3, 0, -1):  # then decode steps, one call of decode_layers each
        step = SeqChunk(ids[-i : len(ids) - i + 1], len(ids) - i, table)
        got.append(run_step(runner, [step], keep_logits=True)[0].logits)
    for row, logits in zip(range(len(ids) - 4, len(ids)), got, strict=True):
        scale = max(1.0, want[row].abs().max().item())
        assert (logits - want[row]).abs().max().item() <= 1e-4 * scale, row


def test_f16_and_bf16_matrices_stay_16_bits_as_the_file_stores_them(
    tiny_pair_factory, tmp_path: Path
) -> None:
    """A GGUF's F16 / BF16 matrices (mistral's attn_output, ffn_down and LM head above) are
    computed from the file's own 2-byte weights, not a float32 copy of twice the bytes."""
    from radixserve.model.quant import QuantLinear

    hf, _ = tiny_pair_factory(arch="mistral", **(SHAPES | EXTRA["mistral"]))
    path = write_tiny_gguf(tmp_path / "tiny-f16.gguf", "mistral", hf, TYPES["mistral"])
    files = resolve_model(str(path), cache_dir=tmp_path / "cache")
    model = load_model(files, torch.float32, torch.device("cpu"), None)
    halves = {}
    for p in model.projections():
        lin = p.lin
        assert isinstance(lin, QuantLinear), p.name
        w = lin.weight
        if w.kind == "gguf" and w.layout is not None and set(w.layout[:, 1].tolist()) <= {1, 30}:
            rows, cols = w.shape
            assert w.qs.numel() * w.qs.element_size() == 2 * rows * cols, p.name
            halves[p.name.rsplit(".", 1)[-1]] = set(w.layout[:, 1].tolist())
    assert halves == {"o_lin": {1}, "down_lin": {30}, "head_lin": {1}}


def test_a_gguf_chat_template_and_end_of_turn_token_carry_over(
    tiny_pair_factory, tmp_path: Path
) -> None:
    """A chat model's file: its tokenizer.chat_template renders chats, and generation stops at
    its <end_of_turn> control token as at its end-of-sequence token."""
    hf, _ = tiny_pair_factory(arch="gemma3", **(SHAPES | EXTRA["gemma3"]))
    template = "{% for m in messages %}<s>{{ m['content'] }}<end_of_turn>{% endfor %}"
    path = write_tiny_gguf(
        tmp_path / "chat.gguf", "gemma3", hf, TYPES["gemma3"], WINDOW, chat_template=template
    )
    files = resolve_model(str(path), cache_dir=tmp_path / "cache")
    tok = Tokenizer.from_dir(files.path)
    assert tok.has_chat_template
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    # <s>, the content (not in the tiny vocabulary: <unk>), <end_of_turn>; per message
    assert tok.apply_chat_template(chat) == [1, 0, 3, 1, 0, 3]
    assert set(ModelConfig.from_dir(files.path).eos_token_ids) == {2, 3}


@pytest.mark.parametrize("arch", list(TYPES))
def test_the_written_tokenizer_is_the_one_autotokenizer_builds_from_the_file(
    tiny_pair_factory, tmp_path: Path, arch: str
) -> None:
    """The model directory's tokenizer, built by the class asked directly, saves the same
    files as AutoTokenizer's own GGUF path (which reads the whole file to learn the type)."""
    from transformers import AutoTokenizer

    hf, _ = tiny_pair_factory(arch=arch, **(SHAPES | EXTRA[arch]))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = write_tiny_gguf(
        tmp_path / f"tiny-{arch}.gguf", arch, hf, TYPES[arch], chat_template=template
    )
    files = resolve_model(str(path), cache_dir=tmp_path / "cache")
    AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name).save_pretrained(
        str(tmp_path / "auto")
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (files.path / name).read_text() == (tmp_path / "auto" / name).read_text(), name
