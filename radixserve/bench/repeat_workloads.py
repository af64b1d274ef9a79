"""Workloads whose outputs repeat text the server has already seen: what speculative decoding
without a draft model (prompt lookup, suffix decoding, the radix tree's own continuations)
feeds on. `edit` asks for a passage back with two lines changed, `rag_extract` asks for a
sentence of the retrieved context quoted verbatim, `regenerate` sends the same request several
times in a row. (The agent loop, whose tool calls repeat, is `AgentLoop` in workloads.py.)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from radixserve.bench.corpus import Corpus
from radixserve.bench.sessions import Session, Workload, docs_assistant_system

# A word worth renaming: an identifier-like run of 4+ characters (so never a lone article).
_WORD = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b")
_NUMBER = re.compile(r"\b\d+\b")
# Replacement words for an edit: plain, and unlikely to be the word they replace.
_NEW_WORDS = ("amount", "buffer", "record", "signal", "target", "window", "marker", "bundle")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
PHRASE_WORDS = 4  # words of the target sentence the rag_extract question quotes


class LineEdit(NamedTuple):
    """One change the edit workload asks for: on `line` (1-based), `old` becomes `new`."""

    line: int
    old: str
    new: str

    def instruction(self) -> str:
        """The change as the prompt words it."""
        return f'On line {self.line}, replace "{self.old}" with "{self.new}".'


def _candidates(line: str) -> list[str]:
    """Numbers and words that occur once in `line` (so an instruction names exactly one)."""
    found = _NUMBER.findall(line) + _WORD.findall(line)
    return [w for w in dict.fromkeys(found) if len(re.findall(rf"\b{re.escape(w)}\b", line)) == 1]


def pick_edits(text: str, rng: random.Random) -> list[LineEdit]:
    """Two changes on two different lines of `text` (one line when it has only one with a
    candidate word): the first renames a word in the first half of the lines, the second
    changes a number (its value + 1) in the second half when one has a number, else renames
    a word there too. Raises ValueError when `text` has no candidate at all."""
    lines = text.split("\n")
    usable = [(i, c) for i, line in enumerate(lines) if (c := _candidates(line))]
    if not usable:
        raise ValueError("the passage has no word to edit")
    half = max(1, len(usable) // 2)
    first_i, first_words = rng.choice(usable[:half])
    words = [w for w in first_words if not w.isdigit()] or first_words
    old = rng.choice(words)
    edits = [LineEdit(first_i + 1, old, _replacement(old, rng))]
    later = [(i, c) for i, c in usable[half:] if i != first_i]
    if not later:  # a one-line passage: a second word of the same line
        rest = [w for w in first_words if w != old]
        if not rest:
            return edits
        later = [(first_i, rest)]
    numbered = [(i, c) for i, c in later if any(w.isdigit() for w in c)]
    second_i, second_words = rng.choice(numbered or later)
    nums = [w for w in second_words if w.isdigit() and w != old]
    if nums:
        old2 = rng.choice(nums)
        edits.append(LineEdit(second_i + 1, old2, str(int(old2) + 1)))
    else:
        old2 = rng.choice([w for w in second_words if w != old] or second_words)
        edits.append(LineEdit(second_i + 1, old2, _replacement(old2, rng)))
    return edits


def _replacement(word: str, rng: random.Random) -> str:
    if word.isdigit():
        return str(int(word) + 1)
    new = rng.choice([w for w in _NEW_WORDS if w != word.lower()])
    return new.capitalize() if word[:1].isupper() else new


def apply_edits(text: str, edits: list[LineEdit]) -> str:
    """`text` with `edits` made: the answer a perfect editor returns."""
    lines = text.split("\n")
    for e in edits:
        lines[e.line - 1] = re.sub(rf"\b{re.escape(e.old)}\b", e.new, lines[e.line - 1], count=1)
    return "\n".join(lines)


@dataclass
class Edit(Workload):
    """A code assistant's rewrite: each request gives ~`passage_tokens` of a stdlib module's
    source (a different module each) and two changes on two named lines, and asks for the
    whole passage back with only those changes; nearly all of the answer is the prompt's own
    text. `max_tokens` is 1.2 x the default passage (room for the passage and a line of
    framing); raise it with `passage_tokens`. `edits` (filled by `sessions`) holds each
    session's two changes, by session id."""

    name: ClassVar[str] = "edit"
    summary: ClassVar[str] = "rewrite ~300 tokens of code with two lines changed (answer ~ prompt)"
    requests: int = 8
    passage_tokens: int = 300
    max_tokens: int = 360

    def __post_init__(self) -> None:
        self.edits: dict[str, list[LineEdit]] = {}

    def sessions(self, corpus: Corpus) -> list[Session]:
        system = (
            "You are a careful code editor. Make exactly the changes asked for and return the "
            "whole code, every other character unchanged, with no commentary."
        )
        out = []
        for i in range(self.requests):
            module, text = corpus.source_passage(self.passage_tokens)
            edits = pick_edits(text, corpus.rng)
            sid = f"edit{i}"
            self.edits[sid] = edits
            steps = "\n".join(f"{k + 1}. {e.instruction()}" for k, e in enumerate(edits))
            ask = (
                f"Rewrite this part of {module}.py with these changes:\n{steps}\n"
                f"Return all of it.\n\n```python\n{text}\n```"
            )
            out.append(Session(sid, [ask], self.max_tokens, system))
        return out

    def num_requests(self) -> int:
        return self.requests


class Quote(NamedTuple):
    """The sentence a rag_extract question asks for, and the phrase the question quotes."""

    sentence: str
    phrase: str


def _flat(text: str) -> str:
    return " ".join(text.split())


def pick_quote(
    docs: list[str], max_tokens: int, count: Callable[[str], int], rng: random.Random
) -> Quote:
    """A sentence of one of `docs` (whitespace collapsed) of 8+ words and at most `max_tokens`
    tokens (`count` measures), and PHRASE_WORDS consecutive words of it that occur once in all
    of `docs`; a line of the docs instead when no sentence qualifies (source code has few
    sentences). ValueError when nothing has a phrase of its own."""
    whole = _flat("\n".join(docs))

    def fitting(pieces: list[str]) -> list[str]:
        out = [p for p in pieces if len(p.split()) >= 8 and count(p) <= max_tokens]
        rng.shuffle(out)
        return out

    sentences = fitting([s for d in docs for s in _SENTENCE_END.split(_flat(d))])
    lines = fitting([_flat(line) for d in docs for line in d.split("\n")])
    for s in sentences + lines:
        words = s.split()
        starts = list(range(1, len(words) - PHRASE_WORDS))
        rng.shuffle(starts)
        for k in starts:
            phrase = " ".join(words[k : k + PHRASE_WORDS])
            if whole.count(phrase) == 1:
                return Quote(s, phrase)
    raise ValueError("no sentence of the context has a phrase of its own")


@dataclass
class RagExtract(Workload):
    """RAG whose answers copy the context: each request retrieves `passages` fresh passages
    (numbered, with their module names) and asks for the sentence that contains a quoted phrase,
    word for word. The asked-for sentence fits in `max_tokens`; `quotes` (filled by `sessions`)
    holds each session's sentence and phrase, by session id."""

    name: ClassVar[str] = "rag_extract"
    summary: ClassVar[str] = "retrieved passages + 'quote the sentence that contains ...'"
    requests: int = 8
    passages: int = 4
    passage_tokens: int = 256
    max_tokens: int = 64

    def __post_init__(self) -> None:
        self.quotes: dict[str, Quote] = {}

    def sessions(self, corpus: Corpus) -> list[Session]:
        system = (
            "Answer from the retrieved documents only. When asked to quote, copy the text "
            "exactly as it appears, without quotation marks or commentary."
        )
        out = []
        for i in range(self.requests):
            named = [corpus.named_passage(self.passage_tokens) for _ in range(self.passages)]
            docs = [text for _, text in named]
            # leave room for a few tokens of framing around the sentence
            quote = pick_quote(docs, self.max_tokens - 8, corpus.counter.count, corpus.rng)
            sid = f"rag{i}"
            self.quotes[sid] = quote
            context = "\n\n".join(
                f"[{k + 1}] {module}.py:\n{text}" for k, (module, text) in enumerate(named)
            )
            ask = (
                f"Retrieved documents:\n\n{context}\n\nQuote, word for word, the sentence of "
                f'the documents above that contains "{quote.phrase}".'
            )
            out.append(Session(sid, [ask], self.max_tokens, system))
        return out

    def num_requests(self) -> int:
        return self.requests


class RepeatSession(Session):
    """A session that sends the same request every turn: turn k+1 goes after turn k's answer
    arrived (as in any session) but its prompt is turn 0's, not a history that grows; the
    answers are still recorded. `inputs` holds the one input once per turn."""

    def messages(self) -> list[dict[str, Any]]:
        """The first turn's chat messages, whatever was answered since."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.inputs[0]}]

    def prompt(self) -> str:
        """The first turn's completion prompt, whatever was answered since."""
        head = self.system + "\n\n" if self.system else ""
        return head + self.inputs[0] + "\n\nAnswer:"


@dataclass
class Regenerate(Workload):
    """A chat user pressing "regenerate": `sessions` questions about a passage behind a shared
    system prompt, each sent `regenerations` times in a row with the same messages (sessions
    interleave); at temperature 0 every regeneration repeats its first answer."""

    name: ClassVar[str] = "regenerate"
    summary: ClassVar[str] = "the same request sent again after each answer (no history)"
    conversations: int = 4
    regenerations: int = 4
    system_tokens: int = 256
    user_tokens: int = 128
    max_tokens: int = 128

    def sessions(self, corpus: Corpus) -> list[Session]:
        system = docs_assistant_system(corpus, self.system_tokens)
        out: list[Session] = []
        for c in range(self.conversations):
            ask = "Explain this passage in a few sentences:\n" + corpus.passage(self.user_tokens)
            inputs = [ask] * self.regenerations
            out.append(RepeatSession(f"regen{c}", inputs, self.max_tokens, system))
        return out

    def num_requests(self) -> int:
        return self.conversations * self.regenerations
