"""Workload generators: deterministic per seed, sized in tokens, and sharing what they claim
(measured by the analyzer on their own output)."""

from __future__ import annotations

import pytest

from radixserve.bench.analyze import TraceRequest, analyze_tokens, shared_prefix_lengths, tokenize
from radixserve.bench.corpus import Corpus, TokenCounter
from radixserve.bench.workloads import (
    WORKLOADS,
    RequestSpec,
    Session,
    build_sessions,
    make_workload,
    script,
)

SMALL = {
    "multi_turn": {"conversations": "3", "turns": "3", "system_tokens": "128", "user_tokens": "24"},
    "rag": {"requests": "5", "preamble_tokens": "512", "question_tokens": "16"},
    "few_shot": {"requests": "5", "exemplars": "3", "exemplar_tokens": "64", "query_tokens": "32"},
    "agent": {"agents": "2", "steps": "3", "system_tokens": "128", "tool_tokens": "48"},
    "unique": {"requests": "8", "prompt_tokens": "128"},
    "spike": {"steady": "4", "docs": "2", "doc_tokens": "128", "hot_tokens": "64"},
    "pd_burst": {"streams": "2", "turns": "2", "bursts": "2", "doc_tokens": "128"},
    "edit": {"requests": "3", "passage_tokens": "120", "max_tokens": "150"},
    "rag_extract": {"requests": "3", "passages": "3", "passage_tokens": "96"},
    "regenerate": {"conversations": "2", "regenerations": "3", "system_tokens": "64"},
}


def specs_for(name: str, seed: int, counter: TokenCounter, api: str | None = None):
    w = make_workload(name, SMALL[name])
    return w, script(build_sessions(w, seed, counter), api or w.default_api)


def prompt_ids(specs: list[RequestSpec], tokenizer) -> list[list[int]]:
    reqs = [TraceRequest(s.id, None, messages=s.messages, prompt=s.prompt) for s in specs]
    return tokenize(reqs, tokenizer)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_is_deterministic_for_a_seed(name, counter):
    _, a = specs_for(name, 7, counter)
    _, b = specs_for(name, 7, counter)
    _, c = specs_for(name, 8, counter)
    assert a == b
    assert [s.messages or s.prompt for s in a] != [s.messages or s.prompt for s in c]


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_sends_the_number_of_requests_it_declares(name, counter):
    w, specs = specs_for(name, 0, counter)
    assert len(specs) == w.num_requests()
    assert len({s.id for s in specs}) == len(specs)


def test_rag_requests_share_the_whole_preamble(counter, tokenizer):
    w, specs = specs_for("rag", 0, counter)
    ids = prompt_ids(specs, tokenizer)
    lcp = shared_prefix_lengths(ids)
    assert lcp[0] == 0
    assert all(x >= w.preamble_tokens for x in lcp[1:])
    # and nothing beyond it plus a few template/question tokens
    assert all(x <= w.preamble_tokens + 24 for x in lcp[1:])


def test_few_shot_requests_share_the_exemplar_block(counter, tokenizer):
    w, specs = specs_for("few_shot", 0, counter)
    lcp = shared_prefix_lengths(prompt_ids(specs, tokenizer))
    block = w.exemplars * w.exemplar_tokens
    assert all(x >= block for x in lcp[1:])


@pytest.mark.parametrize("name", ["multi_turn", "agent"])
def test_each_turn_extends_the_previous_turn_of_its_session(name, counter, tokenizer):
    w, specs = specs_for(name, 0, counter)
    ids = prompt_ids(specs, tokenizer)
    by_session: dict[str, list[int]] = {}
    for spec, toks in zip(specs, ids, strict=True):
        prev = by_session.get(spec.session_id)
        if prev is not None:
            common = next(
                (i for i, (a, b) in enumerate(zip(prev, toks, strict=False)) if a != b), len(prev)
            )
            assert common >= len(prev) - 2  # only the assistant-turn boundary may re-tokenize
            assert len(toks) > len(prev)
        by_session[spec.session_id] = toks
    a = analyze_tokens(ids, capacities=[])
    assert a.redundant_fraction > 0.5


def test_multi_turn_first_turns_share_the_system_prompt(counter, tokenizer):
    w, specs = specs_for("multi_turn", 0, counter)
    firsts = [s for s in specs if s.turn == 0]
    lcp = shared_prefix_lengths(prompt_ids(firsts, tokenizer))
    assert all(x >= w.system_tokens for x in lcp[1:])


def test_next_turn_carries_the_real_previous_answer(counter):
    w = make_workload("multi_turn", SMALL["multi_turn"])
    s = build_sessions(w, 0, counter)[0]
    s.record("ANSWER-ONE")
    chat = s.next_request("chat")
    assert chat.turn == 1 and chat.messages[-2] == {"role": "assistant", "content": "ANSWER-ONE"}
    first_prompt = Session(s.id, s.inputs, s.max_tokens, s.system).prompt()
    assert s.prompt().startswith(first_prompt + "ANSWER-ONE")


@pytest.mark.parametrize("api", ["completion", "chat"])
def test_unique_prompts_share_no_block(api, counter, tokenizer):
    _, specs = specs_for("unique", 0, counter, api)
    a = analyze_tokens(prompt_ids(specs, tokenizer), block_size=16, capacities=[])
    if api == "completion":
        assert a.shared_tokens_block == 0
        assert a.redundant_fraction < 0.01
    else:  # the chat template's own opening (a default system prompt) is one shared block
        assert a.shared_tokens_block <= 32 * len(specs)


def test_passages_are_sized_in_tokens(counter):
    corpus = Corpus("sizes", counter)
    for n in (16, 100, 700):
        assert abs(counter.count(corpus.passage(n)) - n) <= 2


def test_estimated_sizes_without_a_tokenizer():
    est = TokenCounter(None)
    text = Corpus("est", est).passage(100)
    assert len(text) == 400  # ~4 characters per token


def test_make_workload_rejects_unknown_names_and_params():
    with pytest.raises(ValueError):
        make_workload("nope")
    with pytest.raises(ValueError):
        make_workload("rag", {"turns": "3"})
    with pytest.raises(ValueError):
        make_workload("rag", {"requests": "0"})
    assert make_workload("rag", {"requests": "3"}).requests == 3


def test_request_body_asks_for_streamed_usage():
    spec = RequestSpec("x", "s", 0, "completion", 8, prompt="hi")
    body = spec.body("m")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert spec.path == "/v1/completions" and body["prompt"] == "hi"
