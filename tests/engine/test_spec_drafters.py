"""The drafters and `--speculative-config`, without a model."""

from __future__ import annotations

import argparse

import pytest

from radixserve.cache import BlockPool, RadixCache
from radixserve.engine.params import SamplingParams
from radixserve.engine.request import Request
from radixserve.engine.spec_config import (
    SpeculativeConfig,
    parse_speculative_config,
    speculative_config_arg,
)
from radixserve.engine.speculative import PromptLookup, Speculator, SuffixStore
from radixserve.engine.tokenizer import IncrementalDetokenizer


def test_prompt_lookup_drafts_what_followed_the_latest_occurrence() -> None:
    lookup = PromptLookup(2, 3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert lookup.draft(tokens, 2) == [7, 5]  # the latest earlier "1 2 3" was followed by 7 5
    assert lookup.draft([*tokens, 7], 3) == [5, 1, 2]


def test_prompt_lookup_prefers_the_longest_ngram_and_knows_no_unseen_one() -> None:
    lookup = PromptLookup(2, 3)
    tokens = [4, 2, 3, 8, 1, 2, 3, 6, 0, 1, 2, 3]
    assert lookup.draft(tokens, 1) == [6]  # "1 2 3" beats the later-ending "2 3"
    assert PromptLookup(2, 3).draft([1, 2, 3, 4, 5], 3) == []


def test_prompt_lookup_extends_a_loop_past_the_end() -> None:
    assert PromptLookup(2, 4).draft([5, 6, 7, 6, 7], 5) == [6, 7, 6, 7, 6]


def test_prompt_lookup_indexes_tokens_appended_later() -> None:
    lookup = PromptLookup(2, 2)
    tokens = [1, 2, 3]
    assert lookup.draft(tokens, 2) == []
    tokens += [4, 1, 2]
    assert lookup.draft(tokens, 2) == [3, 4]


def test_suffix_store_drafts_within_a_namespace_only() -> None:
    store = SuffixStore(2, 3, capacity=100)
    store.add("a", [1, 2, 3, 4, 5, 6])
    assert store.draft("a", [9, 9, 2, 3], 3) == [4, 5, 6]
    assert store.draft("b", [9, 9, 2, 3], 3) == []
    assert store.draft("a", [9, 9, 6, 2], 3) == []


def test_suffix_store_drops_the_oldest_beyond_its_capacity() -> None:
    store = SuffixStore(2, 2, capacity=10)
    store.add(None, [1, 2, 3, 4, 5, 6])
    store.add(None, [7, 8, 9, 10, 11, 12])
    assert store.num_tokens == 6
    assert store.draft(None, [1, 2], 2) == []
    assert store.draft(None, [7, 8], 2) == [9, 10]
    store.clear()
    assert store.num_tokens == 0 and store.draft(None, [7, 8], 2) == []


def _request(prompt: list[int], output: list[int] = (), namespace: object = None) -> Request:  # type: ignore[assignment]
    req = Request(
        "r",
        prompt,
        SamplingParams(max_tokens=32),
        None,
        IncrementalDetokenizer.__new__(IncrementalDetokenizer),
        namespace=namespace,
    )
    req.token_ids += list(output)
    return req


def test_the_speculator_drafts_from_the_tree_first() -> None:
    cache = RadixCache(BlockPool(16), block_size=4)
    cached = list(range(100, 116))
    blocks = cache.pool.allocate(4)
    cache.insert(cached, blocks)
    spec = Speculator(SpeculativeConfig("radix", 3), cache, pool_tokens=64)
    assert spec.propose(_request(cached[:6]), 8) == cached[6:9]
    ngram = Speculator(SpeculativeConfig("ngram", 3), cache, pool_tokens=64)
    assert ngram.propose(_request(cached[:6]), 8) == []


def test_the_draft_length_adapts_down_to_a_pause_and_back() -> None:
    cache = RadixCache(BlockPool(16), block_size=4)
    spec = Speculator(SpeculativeConfig("ngram", 4), cache, pool_tokens=64)
    req = _request([1, 2, 3, 1, 2, 3, 1, 2])
    assert len(spec.propose(req, 8)) == 4
    spec.observe(req, 4, 1)
    assert len(spec.propose(req, 8)) == 2  # accepted + 1
    spec.observe(req, 2, 0)
    spec.observe(req, 1, 0)  # two misses in a row: a pause of two steps
    assert spec.propose(req, 8) == [] and spec.propose(req, 8) == []
    assert spec.propose(req, 8) != []
    spec.observe(req, 1, 1)
    assert len(spec.propose(req, 8)) == 2  # a fully accepted draft doubles
    spec.observe(req, 2, 2)
    assert len(spec.propose(req, 8)) == 4


def test_finished_outputs_draft_for_later_requests_of_the_same_namespace() -> None:
    cache = RadixCache(BlockPool(16), block_size=4)
    spec = Speculator(SpeculativeConfig("suffix", 3), cache, pool_tokens=64)
    done = _request([7, 7, 8, 9], [20, 21, 22, 23], namespace="t1")
    spec.finish(done)
    assert spec.propose(_request([5, 8, 9], namespace="t1"), 3) == [20, 21, 22]
    assert spec.propose(_request([5, 8, 9], namespace="t2"), 3) == []


def test_config_takes_vllm_keys_with_defaults() -> None:
    c = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    )
    assert c == SpeculativeConfig("ngram", 3, 2, 5)
    assert parse_speculative_config({}) == SpeculativeConfig()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{method: ngram}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "eagle"}', "method 'eagle' is not one of ngram, suffix, radix"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer in [1, 16]"),
        ('{"num_speculative_tokens": "4"}', "num_speculative_tokens must be an integer"),
        ('{"draft_model": "x"}', "unknown key 'draft_model'"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "is above prompt_lookup_max"),
    ],
)
def test_a_malformed_config_is_one_clear_line(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as e:
        speculative_config_arg(text)
    assert says in str(e.value) and "\n" not in str(e.value)
