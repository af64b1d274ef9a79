"""With the real default model in float32, the prefix cache changes nothing but speed."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.engine.llm import LLM
from radixserve.engine.params import SamplingParams
from radixserve.engine.tokenizer import Tokenizer

SYSTEM = (
    "You are a meticulous assistant for a public library. You answer questions about "
    "opening hours, borrowing rules, late fees, interlibrary loans, study rooms and the "
    "history of the building. Keep answers short, cite the rule you rely on, and never "
    "invent a policy that is not listed here. Rules: books may be borrowed for three weeks; "
    "late fees are ten cents a day; study rooms are booked in two-hour slots."
)
QUESTIONS = [
    "How long can I keep a book?",
    "What is the late fee?",
    "Can I book a study room for four hours?",
    "Who built the library?",
]
BS = 16


def workload(tok: Tokenizer) -> list[list[int]]:
    """Prompts sharing prefixes in different ways: system prompt, multi-turn growth,
    partial overlap, and an exact repeat."""
    sys_msg = {"role": "system", "content": SYSTEM}
    prompts = [
        tok.apply_chat_template([sys_msg, {"role": "user", "content": q}]) for q in QUESTIONS
    ]
    turns = [sys_msg, {"role": "user", "content": "I want to borrow a novel."}]
    for reply, follow in [
        ("Sure, you can keep it for three weeks.", "And if I am late?"),
        ("Then the fee is ten cents a day.", "Can I renew it online?"),
        ("Yes, once, from your account page.", "Thanks! One more question."),
    ]:
        prompts.append(tok.apply_chat_template(turns))
        turns = turns + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": follow},
        ]
    prompts.append(tok.apply_chat_template(turns))
    base = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    prompts.append(base + tok.encode(" What animal jumps?"))
    prompts.append(base[:37] + tok.encode(" Something else entirely happens here."))
    prompts.append(tok.encode("An unrelated prompt about the ocean and its tides."))
    prompts.append(list(prompts[0]))  # exact repeat
    prompts.append(list(prompts[5]))  # exact repeat of a multi-turn prompt
    return prompts


@pytest.fixture(scope="module")
def engines(default_model_files):
    out = {}
    for on in (True, False):
        cfg = EngineConfig(
            dtype="float32",
            kv_cache_memory="512MiB",
            enable_prefix_cache=on,
            max_num_batched_tokens=256,
        )
        out[on] = LLM.from_engine(LLMEngine(cfg))
    yield out
    for llm in out.values():
        llm.shutdown()


def run(llm: LLM, prompts: list[list[int]], one_by_one: bool):
    params = SamplingParams(max_tokens=8, temperature=0.0, return_logits=True, ignore_eos=True)
    if one_by_one:
        return [llm.generate([p], params)[0] for p in prompts]
    return llm.generate(prompts, params)


def expected_cached(prompts: list[list[int]], outputs) -> list[int]:
    """Cached tokens each request should see when run one by one with no eviction."""
    seen: list[list[int]] = []
    expected = []
    for p, out in zip(prompts, outputs, strict=True):
        key = p[:-1]
        best = 0
        for s in seen:
            n = 0
            for a, b in zip(key, s, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n // BS * BS)
        expected.append(best)
        seen.append(p + out.token_ids[:-1])  # the last sampled token is never computed
    return expected


@pytest.mark.parametrize("one_by_one", [True, False], ids=["one_by_one", "all_at_once"])
def test_cache_on_and_off_give_identical_greedy_tokens(
    engines, default_tokenizer, one_by_one
) -> None:
    prompts = workload(default_tokenizer)
    assert len(prompts) >= 12
    # Fresh caches for each mode: evict everything the previous test left.
    engines[True].engine.kv.cache.evict(10**9)
    on = run(engines[True], prompts, one_by_one)
    off = run(engines[False], prompts, one_by_one)
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids
        assert b.num_cached_tokens == 0
        for la, lb in zip(a.logits, b.logits, strict=True):
            assert torch.max(torch.abs(la - lb)).item() <= 1e-3
    if one_by_one:
        assert [o.num_cached_tokens for o in on] == expected_cached(prompts, on)
    assert sum(o.num_cached_tokens > 0 for o in on) >= 8


def test_multi_turn_reuse_covers_generated_tokens(engines) -> None:
    llm = engines[True]
    prompt = list(range(1000, 1100))  # 100 tokens
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert len(first.token_ids) == 50
    follow = prompt + first.token_ids + list(range(2000, 2020))
    second = llm.generate([follow], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert second.num_cached_tokens == 144  # all whole blocks of the 149 computed tokens
