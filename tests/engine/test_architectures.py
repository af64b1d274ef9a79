"""Every architecture through the engine: with the prefix cache on, the greedy tokens are those
of the cache off, for prompts that share prefixes longer than the tiny configs' sliding
window, prefilled in chunks, decoded in batches (dense and 4-bit weights: the 4-bit decode
steps run in one `decode_layers` call)."""

from __future__ import annotations

import random

import pytest

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.params import SamplingParams
from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.weights import quantize_model
from tests.support.models import ARCHITECTURES, TINY_WINDOW


def prompts() -> list[list[int]]:
    """Prompts sharing a 30-token prefix (several windows long), a multi-turn growth and an
    exact repeat."""
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(30)]
    out = [shared + [rng.randrange(100, 40000) for _ in range(n)] for n in (5, 13, 1)]
    out.append(out[1] + [rng.randrange(100, 40000) for _ in range(9)])
    out.append(list(out[0]))
    assert all(len(p) > 3 * TINY_WINDOW for p in out)
    return out


def generate(engine: LLMEngine, batch: list[list[int]], one_by_one: bool) -> list:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def collect(out) -> None:
        if out.finished:
            outs[out.request_id], cached[out.request_id] = out.token_ids, out.num_cached_tokens

    groups = [[p] for p in batch] if one_by_one else [batch]
    ids = []
    for group in groups:
        ids += [engine.add_request(p, params, on_output=collect) for p in group]
        while engine.scheduler.has_work() or engine._inbox:
            engine.step()
            engine.kv.check_invariants()
    return [(outs[i], cached[i]) for i in ids]


# The 4-bit runs (decode steps in one decode_layers call) are the slow tier's: the fast tier
# has decode_layers == the layer-by-layer step for every architecture (tests/model).
@pytest.mark.parametrize(
    "quantized", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dense", "int4"]
)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cache_on_and_off_give_the_same_greedy_tokens(
    tiny_pair_factory, default_tokenizer: Tokenizer, arch: str, quantized: bool
) -> None:
    _, model = tiny_pair_factory(
        arch=arch,
        vocab_size=len(default_tokenizer.hf),
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=512,
    )
    if quantized:
        quantize_model(model, "int4")
    results = {}
    for on in (True, False):
        cfg = EngineConfig(
            block_size=4,
            num_blocks=96,
            max_num_batched_tokens=16,  # prompts prefill in several chunks
            enable_prefix_cache=on,
        )
        engine = LLMEngine.from_parts(cfg, model, default_tokenizer, "tiny")
        results[on] = generate(engine, prompts(), one_by_one=True)
        results[on] += generate(engine, prompts(), one_by_one=False)
    tokens_on = [t for t, _ in results[True]]
    assert tokens_on == [t for t, _ in results[False]]
    assert all(c == 0 for _, c in results[False])
    assert sum(c >= 28 for _, c in results[True]) >= 6  # the shared prefix came from the tree
