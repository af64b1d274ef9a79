"""Workload generators: sessions of requests with a known prefix-sharing structure.

A workload builds a list of `Session`s. A session is a script of user-side inputs; turn k+1 is
sent only after turn k's answer arrived, and its prompt contains that real answer (multi-turn
chat, agent loop). Single-request workloads (shared preamble, few-shot, unique) are sessions of
one turn. Sizes are in tokens of message text (template tokens not counted), measured with the
model's tokenizer when one is given, else estimated at ~4 characters per token.

The pieces (`RequestSpec`, `Session`, `Workload`) are in sessions.py; the workloads whose
outputs repeat text already seen (edit, rag_extract, regenerate) in repeat_workloads.py;
`WORKLOADS` here names them all.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from radixserve.bench.corpus import Corpus, TokenCounter
from radixserve.bench.repeat_workloads import Edit, RagExtract, Regenerate
from radixserve.bench.sessions import APIS, RequestSpec, Session, Workload, docs_assistant_system
from radixserve.bench.tools import AGENT_TOOLS

__all__ = [
    "APIS",
    "SUITE_WORKLOADS",
    "WORKLOADS",
    "RequestSpec",
    "Session",
    "Workload",
    "build_sessions",
    "make_workload",
    "script",
    "workload_name",
]


@dataclass
class MultiTurn(Workload):
    """N conversations interleaved; each turn appends the previous answer and a new user message
    after a system prompt shared by all conversations."""

    name: ClassVar[str] = "multi_turn"
    summary: ClassVar[str] = "chat: shared system prompt + growing per-conversation history"
    conversations: int = 8
    turns: int = 4
    system_tokens: int = 512
    user_tokens: int = 64
    max_tokens: int = 32

    def sessions(self, corpus: Corpus) -> list[Session]:
        system = docs_assistant_system(corpus, self.system_tokens)
        return [
            Session(
                f"conv{c}",
                [
                    "Explain this passage briefly:\n" + corpus.passage(self.user_tokens)
                    for _ in range(self.turns)
                ],
                self.max_tokens,
                system,
            )
            for c in range(self.conversations)
        ]

    def num_requests(self) -> int:
        return self.conversations * self.turns


@dataclass
class SharedPreamble(Workload):
    """RAG: a long fixed instruction + context block, then a short unique question."""

    name: ClassVar[str] = "rag"
    summary: ClassVar[str] = "long fixed instruction + context, short unique question"
    requests: int = 8  # a cold 4k-token prefill costs seconds on a small CPU
    preamble_tokens: int = 4096
    question_tokens: int = 32
    max_tokens: int = 16
    contexts: int = 1  # distinct preambles, used round-robin

    def sessions(self, corpus: Corpus) -> list[Session]:
        head = (
            "Answer the question using only the context below. Be brief and cite the module "
            "the answer comes from.\n\nContext:\n"
        )
        body_tokens = self.preamble_tokens - corpus.counter.count(head)
        preambles = [head + corpus.passage(body_tokens) for _ in range(self.contexts)]
        return [
            Session(
                f"q{i}",
                ["Question: " + corpus.passage(self.question_tokens)],
                self.max_tokens,
                preambles[i % self.contexts],
            )
            for i in range(self.requests)
        ]

    def num_requests(self) -> int:
        return self.requests


@dataclass
class FewShot(Workload):
    """A fixed block of exemplars (text -> one-line summary), then a varied query."""

    name: ClassVar[str] = "few_shot"
    summary: ClassVar[str] = "fixed exemplar block, varied query"
    requests: int = 16
    exemplars: int = 8
    exemplar_tokens: int = 160
    query_tokens: int = 96
    max_tokens: int = 16

    def sessions(self, corpus: Corpus) -> list[Session]:
        shots = []
        for _ in range(self.exemplars):
            text = corpus.passage(self.exemplar_tokens)
            first = " ".join(text.split()).split(". ")[0].rstrip(".") + "."
            shots.append(f"Text: {text}\nSummary: {first}")
        system = "Summarize each text in one sentence, as in these examples.\n\n" + "\n\n".join(
            shots
        )
        return [
            Session(
                f"q{i}",
                [f"Text: {corpus.passage(self.query_tokens)}\nSummary:"],
                self.max_tokens,
                system,
            )
            for i in range(self.requests)
        ]

    def num_requests(self) -> int:
        return self.requests


@dataclass
class AgentLoop(Workload):
    """Agents working a task with tools: a fixed system prompt and the same five tool schemas
    (AGENT_TOOLS) every turn; each step appends the model's answer (its tool call) and the
    tool's output to a growing history. Turn k sends tool_choice "required" (decoding
    constrained to a valid call) when k % required_every == 0, else "auto" (free decoding)."""

    name: ClassVar[str] = "agent"
    summary: ClassVar[str] = "system prompt + 5 tool schemas every turn, tool outputs appended"
    agents: int = 4
    steps: int = 6
    system_tokens: int = 384
    task_tokens: int = 64
    tool_tokens: int = 192
    max_tokens: int = 48
    required_every: int = 2

    def sessions(self, corpus: Corpus) -> list[Session]:
        head = (
            "You are a coding agent working in a Python project. Use the tools: call one "
            "tool per turn, read its output, then decide the next step.\n\nProject notes:\n"
        )
        system = head + corpus.passage(self.system_tokens - corpus.counter.count(head))
        choices = [
            "required" if k % self.required_every == 0 else "auto" for k in range(self.steps)
        ]
        out = []
        for a in range(self.agents):
            inputs = ["Task: " + corpus.passage(self.task_tokens)]
            for _ in range(self.steps - 1):
                module, text = corpus.named_passage(self.tool_tokens)
                inputs.append(f"{module}.py:\n{text}")
            session = Session(f"agent{a}", inputs, self.max_tokens, system)
            session.tools, session.tool_choices = AGENT_TOOLS, choices
            out.append(session)
        return out

    def num_requests(self) -> int:
        return self.agents * self.steps


@dataclass
class UniquePrompts(Workload):
    """No sharing at all (the cache's overhead case): every prompt is fresh text. Sent as
    completions by default, since a chat template adds its own shared opening."""

    name: ClassVar[str] = "unique"
    default_api: ClassVar[str] = "completion"
    summary: ClassVar[str] = "no shared prefixes (overhead case)"
    requests: int = 16
    prompt_tokens: int = 512
    max_tokens: int = 16

    def sessions(self, corpus: Corpus) -> list[Session]:
        tail = "\n\nSummarize the text above in one sentence."
        n = self.prompt_tokens - corpus.counter.count(tail)
        return [
            Session(f"p{i}", [corpus.passage(n) + tail], self.max_tokens)
            for i in range(self.requests)
        ]

    def num_requests(self) -> int:
        return self.requests


@dataclass
class Spike(Workload):
    """Eviction under a load spike: steady questions behind a few hot system prompts, then a
    burst of one-off long documents (each followed by one steady question), then steady
    questions again. Session ids name the phase: pre-*, burst-*, post-*; `hot_prefix_tokens`
    (filled by `sessions`) holds each hot prompt's length. The default burst is 6 x 2048 =
    12k tokens, about twice a 256 MiB float32 pool of the default model (use docs=12 for
    bfloat16)."""

    name: ClassVar[str] = "spike"
    default_api: ClassVar[str] = "completion"
    summary: ClassVar[str] = "hot system prompts, then a burst of one-off long documents"
    hot_prompts: int = 3
    hot_tokens: int = 384
    question_tokens: int = 24
    steady: int = 12  # steady requests before the burst, and again after it
    docs: int = 6
    doc_tokens: int = 2048
    max_tokens: int = 8

    def __post_init__(self) -> None:
        self.hot_prefix_tokens: dict[str, int] = {}  # hot prompt (h0, h1, ...) -> its tokens

    def sessions(self, corpus: Corpus) -> list[Session]:
        hot = []
        for k in range(self.hot_prompts):
            head = f"You are support assistant #{k} for the Python standard library. Notes:\n\n"
            hot.append(head + corpus.passage(self.hot_tokens - corpus.counter.count(head)))
            self.hot_prefix_tokens[f"h{k}"] = corpus.counter.count(hot[-1])

        def question(phase: str, i: int) -> Session:
            k = i % self.hot_prompts
            q = "Question: " + corpus.passage(self.question_tokens)
            return Session(f"{phase}-h{k}-{i}", [q], self.max_tokens, hot[k])

        out = [question("pre", i) for i in range(self.steady)]
        for j in range(self.docs):
            doc = "Summarize this document:\n" + corpus.passage(self.doc_tokens)
            out.append(Session(f"burst-doc{j}", [doc], self.max_tokens))
            out.append(question("burst", j))
        out += [question("post", i) for i in range(self.steady)]
        return out

    def num_requests(self) -> int:
        return 2 * self.steady + 2 * self.docs


@dataclass
class PrefillBurst(Workload):
    """Decode streams under prefill bursts (prefill/decode disaggregation's case): `streams`
    chats whose turns answer at length (`stream_tokens`), behind one shared system prompt,
    while `bursts` one-off long documents (`doc_tokens`, a short answer each) arrive among
    them. Session ids say which: stream-* and burst-*. Run it at concurrency streams + 1 so
    that documents arrive while the streams decode; bench/pd_burst.py reports the streams'
    time per output token, the documents' TTFT and the streams' cached share."""

    name: ClassVar[str] = "pd_burst"
    summary: ClassVar[str] = "chats decoding at length while long new documents arrive"
    streams: int = 4
    turns: int = 3
    system_tokens: int = 256
    user_tokens: int = 48
    stream_tokens: int = 96
    bursts: int = 6
    doc_tokens: int = 2048
    burst_tokens: int = 4

    def sessions(self, corpus: Corpus) -> list[Session]:
        system = docs_assistant_system(corpus, self.system_tokens)
        streams = [
            Session(
                f"stream-{c}",
                [
                    "Explain this passage at length:\n" + corpus.passage(self.user_tokens)
                    for _ in range(self.turns)
                ],
                self.stream_tokens,
                system,
            )  # fmt: skip
            for c in range(self.streams)
        ]
        docs = [
            Session(
                f"burst-{j}",
                ["Summarize this document:\n" + corpus.passage(self.doc_tokens)],
                self.burst_tokens,
            )
            for j in range(self.bursts)
        ]
        out: list[Session] = []  # streams first, then a document after each stream's turn
        for j in range(max(len(streams), len(docs))):
            out += streams[j : j + 1] + docs[j : j + 1]
        return out

    def num_requests(self) -> int:
        return self.streams * self.turns + self.bursts


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w
    for w in (
        MultiTurn,
        SharedPreamble,
        FewShot,
        AgentLoop,
        UniquePrompts,
        Spike,
        PrefillBurst,
        Edit,
        RagExtract,
        Regenerate,
    )
}
SUITE_WORKLOADS = ("multi_turn", "rag", "few_shot", "agent", "unique")
"""The workloads `bench --suite` runs by default (cache on vs off)."""


def workload_name(name: str) -> str:
    """The registered spelling of a workload name: hyphens read as underscores
    (`rag-extract` is `rag_extract`)."""
    return name.strip().replace("-", "_")


def make_workload(name: str, params: dict[str, str] | None = None) -> Workload:
    """A workload by name (hyphens or underscores) with some size parameters overridden
    (`{"turns": "6"}`)."""
    name = workload_name(name)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    cls = WORKLOADS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if key not in fields:
            raise ValueError(f"{name} has no parameter {key!r}; it has {', '.join(fields)}")
        kwargs[key] = int(value)
        if kwargs[key] < 1:
            raise ValueError(f"{name}.{key} must be >= 1")
    return cls(**kwargs)


def build_sessions(
    workload: Workload, seed: int, counter: TokenCounter | None = None
) -> list[Session]:
    """The workload's sessions for `seed`; the corpus is keyed by workload name and seed."""
    return workload.sessions(Corpus(f"{workload.name}:{seed}", counter))


def placeholder_answer(spec: RequestSpec) -> str:
    """A stand-in answer for dry runs and tests (no server)."""
    return f" This is the answer to request {spec.id}."


def script(
    sessions: list[Session],
    api: str,
    answer: Callable[[RequestSpec], str] = placeholder_answer,
) -> list[RequestSpec]:
    """Run the sessions one request at a time, round-robin (the order a concurrency-1 run sends
    them in), answering with `answer`; returns every request in send order."""
    ready = deque(sessions)
    out = []
    while ready:
        s = ready.popleft()
        spec = s.next_request(api)
        out.append(spec)
        s.record(answer(spec))
        if not s.done:
            ready.append(s)
    return out
