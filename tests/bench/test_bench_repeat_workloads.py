"""The workloads whose outputs repeat text the server has seen (edit, rag_extract, regenerate):
what each request asks for, that the asked-for answer is in the prompt, their sizes, and the
names the command line accepts."""

from __future__ import annotations

import argparse
import random

import pytest

from radixserve.bench.cli import add_bench_args
from radixserve.bench.corpus import Corpus
from radixserve.bench.repeat_workloads import (
    PHRASE_WORDS,
    LineEdit,
    RepeatSession,
    apply_edits,
    pick_edits,
    pick_quote,
)
from radixserve.bench.workloads import WORKLOADS, build_sessions, make_workload, script


def built(name: str, counter, **params: str):
    w = make_workload(name, params)
    sessions = build_sessions(w, 0, counter)
    return w, sessions, script(sessions, w.default_api)


def fenced(text: str) -> str:
    """The text between the prompt's ``` fences."""
    return text.split("```python\n", 1)[1].rsplit("\n```", 1)[0]


@pytest.mark.parametrize("name", ["edit", "rag_extract", "regenerate", "agent"])
def test_repeat_workloads_are_registered_and_default_to_chat(name):
    assert WORKLOADS[name].default_api == "chat"


@pytest.mark.parametrize("spelling", ["rag-extract", "rag_extract", " rag-extract"])
def test_make_workload_accepts_hyphens_for_underscores(spelling):
    assert make_workload(spelling).name == "rag_extract"


def test_the_command_line_accepts_the_hyphenated_workload_name():
    p = argparse.ArgumentParser()
    add_bench_args(p)
    assert p.parse_args(["--workload", "rag-extract"]).workload == "rag_extract"
    with pytest.raises(SystemExit):
        p.parse_args(["--workload", "rag-extracts"])


def test_edit_asks_for_the_whole_passage_back_with_two_named_lines_changed(counter):
    w, _, specs = built("edit", counter, requests="4", passage_tokens="300")
    assert w.max_tokens >= 1.2 * w.passage_tokens
    for spec in specs:
        ask = spec.messages[-1]["content"]
        passage = fenced(ask)
        assert abs(counter.count(passage) - w.passage_tokens) <= 4
        edits = w.edits[spec.session_id]
        assert len(edits) == 2 and edits[0].line != edits[1].line
        lines = passage.split("\n")
        for e in edits:
            assert e.instruction() in ask
            assert e.old != e.new and e.old in lines[e.line - 1]
        answer = apply_edits(passage, edits).split("\n")
        changed = [i for i, (a, b) in enumerate(zip(lines, answer, strict=True)) if a != b]
        assert [i + 1 for i in changed] == [e.line for e in edits]


def test_edit_changes_a_number_when_the_second_half_has_one():
    text = "\n".join(["alpha beta gamma"] * 4 + ["delta 41 epsilon"] * 4)
    edits = pick_edits(text, random.Random(0))
    assert edits[0].line <= 4 and edits[0].old in {"alpha", "beta", "gamma"}
    assert edits[1] == LineEdit(edits[1].line, "41", "42") and edits[1].line > 4


def test_edit_keeps_the_case_of_a_renamed_word():
    edits = pick_edits("Widget only\nsecond gadget", random.Random(3))
    assert edits[0].old == "Widget" and edits[0].new[0].isupper()


def test_edit_refuses_a_passage_with_nothing_to_change():
    with pytest.raises(ValueError):
        pick_edits("a b c\n\n!!", random.Random(0))


def test_rag_extract_quotes_a_sentence_of_the_context_by_a_phrase_found_once(counter):
    w, _, specs = built("rag_extract", counter, requests="4", passages="4")
    for spec in specs:
        ask = spec.messages[-1]["content"]
        quote = w.quotes[spec.session_id]
        flat = " ".join(ask.split())
        context = flat.split(" Quote, word for word,")[0]
        assert quote.sentence in context
        assert context.count(quote.phrase) == 1 and quote.phrase in quote.sentence
        assert len(quote.phrase.split()) == PHRASE_WORDS
        assert f'contains "{quote.phrase}"' in ask
        assert counter.count(quote.sentence) <= w.max_tokens - 8
        assert ask.count("\n[") == w.passages  # numbered retrieved documents


def test_rag_extract_falls_back_to_a_line_when_no_sentence_fits():
    lines = ["x = call(a, b, c, d, e, f, g)", "y = other(h, i, j, k, l, m, n)"]
    chars = len  # a "token" per character: the unpunctuated whole (one sentence) is too long
    quote = pick_quote(["\n".join(lines)], 40, chars, random.Random(0))
    assert quote.sentence in lines


def test_regenerate_sends_the_same_request_after_each_answer(counter):
    w, sessions, specs = built("regenerate", counter, conversations="3", regenerations="4")
    assert all(isinstance(s, RepeatSession) for s in sessions)
    assert len(specs) == w.num_requests() == 12
    by_session: dict[str, list] = {}
    for spec in specs:
        by_session.setdefault(spec.session_id, []).append(spec)
    assert len(by_session) == 3
    for same in by_session.values():
        assert [s.turn for s in same] == [0, 1, 2, 3]
        assert all(s.messages == same[0].messages for s in same)  # no growing history
        assert [m["role"] for m in same[0].messages] == ["system", "user"]
    firsts = [s.messages for s in specs[:3]]  # sessions interleave: each one's first turn first
    assert len({str(m) for m in firsts}) == 3
    assert len({s.messages[0]["content"] for s in specs}) == 1  # one shared system prompt


def test_regenerate_completion_prompt_is_the_same_every_turn(counter):
    w = make_workload("regenerate", {"conversations": "1", "regenerations": "3"})
    session = build_sessions(w, 0, counter)[0]
    first = session.next_request("completion").prompt
    session.record(" an answer")
    assert session.next_request("completion").prompt == first
    assert session.answers == [" an answer"] and not session.done


def test_source_passages_are_code_of_a_different_module_each(counter):
    corpus = Corpus("source", counter)
    got = [corpus.source_passage(200) for _ in range(4)]
    assert len({module for module, _ in got}) == 4
    for _, text in got:
        assert text.startswith(("def ", "class ")) and abs(counter.count(text) - 200) <= 2
