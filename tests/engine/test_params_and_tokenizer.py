"""Sampling parameter validation and incremental detokenization."""

from __future__ import annotations

import pytest

from radixserve.engine.params import SamplingParams
from radixserve.engine.tokenizer import IncrementalDetokenizer
from radixserve.errors import InvalidRequestError


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"max_tokens": 2.5},
        {"temperature": -1},
        {"temperature": float("nan")},
        {"temperature": "hot"},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"seed": "x"},
        {"stop": [""]},
        {"stop": ["x"] * 100},
        {"stop_token_ids": [-1]},
    ],
)
def test_impossible_sampling_params_raise(kwargs) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string() -> None:
    assert SamplingParams(stop="END").stop == ["END"]


def test_greedy_when_temperature_zero() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_incremental_detokenization_never_splits_a_character(default_tokenizer) -> None:
    text = "naïve café — 日本語のテキスト 🙂 done"
    ids = default_tokenizer.encode(text)
    detok = IncrementalDetokenizer(default_tokenizer, default_tokenizer.encode("Say:"))
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_chat_template_rejects_unknown_roles(default_tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        default_tokenizer.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(InvalidRequestError):
        default_tokenizer.apply_chat_template([])
    with pytest.raises(InvalidRequestError):
        default_tokenizer.apply_chat_template([{"role": "user", "content": 5}])
