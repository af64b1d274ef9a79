"""Gemma 3 270M (Q4_K_M GGUF, real weights): radixserve's greedy tokens equal transformers'
loading the same file in float32, and the prefix cache changes nothing, for prompts longer
than the model's 512-token sliding window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.llm import LLM
from radixserve.engine.params import SamplingParams

pytestmark = pytest.mark.slow  # loads a 270M model twice (ours and transformers')

STORY = (
    "The lighthouse keeper rowed out every morning to check the nets, counting the gulls "
    "that followed the boat and writing each number in a small leather notebook. "
)


@pytest.fixture(scope="module")
def engines(gemma_gguf: Path):
    out = {}
    for on in (True, False):
        cfg = EngineConfig(
            model=str(gemma_gguf),
            dtype="float32",
            kv_cache_memory="512MiB",
            enable_prefix_cache=on,
            max_num_batched_tokens=256,  # long prompts prefill in several chunks
        )
        out[on] = LLM.from_engine(LLMEngine(cfg))
    yield out
    for llm in out.values():
        llm.shutdown()


def prompt_ids(llm: LLM, text: str) -> list[int]:
    bos = llm.tokenizer.bos_token_id
    assert bos is not None
    return [bos, *llm.tokenizer.encode(text)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_gguf_runs_on_its_own_blocks_with_decode_in_one_kernel_call(engines) -> None:
    engine = engines[True].engine
    assert engine.quantization == "gguf"
    model = engine.runner.model
    assert model.config.architecture == "Gemma3ForCausalLM"
    assert model.fused_decode_unavailable() is None
    kinds = {name.rpartition(".")[2]: w.kind for name, w in model.quantized_weights()}
    # The file's values throughout: Q5_0 q/k with Q8_0 v, Q5_0 gate/up and the Q8_0 head as
    # int8 codes, the Q4_K output projection as int4 codes, the Q6_K down projection as stored.
    assert kinds == {
        "qkv_lin": "int8",
        "o_lin": "int4",
        "gate_up_lin": "int8",
        "down_lin": "gguf",
        "head_lin": "int8",
    }


def test_32_greedy_tokens_equal_transformers_on_the_same_gguf(engines, gemma_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    llm = engines[False]
    ids = prompt_ids(llm, STORY * 18 + "One morning the notebook was gone, and")
    assert len(ids) > 512  # past the sliding window of the local layers
    ours = llm.generate([ids], greedy(32))[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(
        str(gemma_gguf.parent), gguf_file=gemma_gguf.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
        )[0, len(ids) :].tolist()
    assert len(ref) == 32
    assert ours == ref


def test_cache_on_and_off_give_the_same_greedy_tokens(engines) -> None:
    on, off = engines[True], engines[False]
    shared = STORY * 17
    prompts = [
        prompt_ids(on, shared + "The gulls that morning numbered"),
        prompt_ids(on, shared + "Years later, his daughter found"),
        prompt_ids(on, shared + "The gulls that morning numbered"),  # an exact repeat
    ]
    outs = {}
    for name, llm in (("on", on), ("off", off)):
        outs[name] = [llm.generate([p], greedy(32))[0] for p in prompts]
    assert [o.token_ids for o in outs["on"]] == [o.token_ids for o in outs["off"]]
    assert all(o.num_cached_tokens == 0 for o in outs["off"])
    assert outs["on"][1].num_cached_tokens >= 512  # the shared prefix, past the window
    assert outs["on"][2].num_cached_tokens >= len(prompts[2]) - 16
