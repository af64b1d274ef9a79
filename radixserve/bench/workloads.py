"""Workload generators: sessions of requests with a known prefix-sharing structure.

A workload builds a list of `Session`s. A session is a script of user-side inputs; turn k+1 is
sent only after turn k's answer arrived, and its prompt contains that real answer (multi-turn
chat, agent loop). Single-request workloads (shared preamble, few-shot, unique) are sessions of
one turn. Sizes are in tokens of message text (template tokens not counted), measured with the
model's tokenizer when one is given, else estimated at ~4 characters per token.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixserve.bench.corpus import Corpus, TokenCounter
from radixserve.bench.tools import AGENT_TOOLS

APIS = ("chat", "completion")


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: chat messages or a completion prompt, its output budget, and
    fields of its own (`extra`: the agent workload's tools and tool_choice)."""

    id: str
    session_id: str
    turn: int
    api: str
    max_tokens: int
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        """The OpenAI endpoint path for this request."""
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def body(self, model: str, temperature: float = 0.0, **extra: Any) -> dict[str, Any]:
        """The OpenAI request body (streaming, with the usage chunk requested)."""
        body: dict[str, Any] = {"model": model}
        if self.api == "chat":
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        body.update(
            max_tokens=self.max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
        )
        body.update(self.extra)
        body.update(extra)
        return body


@dataclass
class Session:
    """A conversation script; `answers` (and `calls`, the tool calls of each answer) fill in as
    the server replies. A session with `tools` sends them with each chat turn, with
    `tool_choices[k]` on turn k; an input that follows an answer with tool calls goes back as
    the `tool` message answering its first call (the agent loop's tool output)."""

    id: str
    inputs: list[str]
    max_tokens: int
    system: str | None = None
    answers: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choices: list[str] | None = None
    calls: list[list[dict[str, Any]]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """Whether every turn has been answered."""
        return len(self.answers) >= len(self.inputs)

    def messages(self) -> list[dict[str, Any]]:
        """Chat messages for the next turn: system, earlier turns with real answers (and their
        tool calls, each answered by a `tool` message), new input."""
        k = len(self.answers)
        msgs: list[dict[str, Any]] = []
        if self.system:
            msgs.append({"role": "system", "content": self.system})
        msgs.append({"role": "user", "content": self.inputs[0]})
        for i in range(k):
            calls = self.calls[i] if i < len(self.calls) else []
            if not calls:
                msgs.append({"role": "assistant", "content": self.answers[i]})
                msgs.append({"role": "user", "content": self.inputs[i + 1]})
                continue
            msgs.append({"role": "assistant", "content": self.answers[i], "tool_calls": calls})
            for j, call in enumerate(calls):  # every call gets its answer; the first, the input
                out = self.inputs[i + 1] if j == 0 else "(done)"
                msgs.append({"role": "tool", "tool_call_id": call["id"], "content": out})
        return msgs

    def prompt(self) -> str:
        """Completion prompt for the next turn; each turn's prompt extends the previous one's
        prompt plus its answer verbatim, so the text prefix is exact."""
        k = len(self.answers)
        out = self.system + "\n\n" if self.system else ""
        for i in range(k + 1):
            out += self.inputs[i] + "\n\nAnswer:"
            if i < k:
                out += self.answers[i] + "\n\n"
        return out

    def next_request(self, api: str) -> RequestSpec:
        """The request for the next unanswered turn (with the session's tools on chat)."""
        k = len(self.answers)
        rid = f"{self.id}-t{k}"
        if api == "chat":
            extra: dict[str, Any] = {}
            if self.tools:
                choice = self.tool_choices[k] if self.tool_choices else "auto"
                extra = {"tools": self.tools, "tool_choice": choice, "parallel_tool_calls": False}
            msgs = self.messages()
            return RequestSpec(rid, self.id, k, api, self.max_tokens, messages=msgs, extra=extra)
        return RequestSpec(rid, self.id, k, api, self.max_tokens, prompt=self.prompt())

    def record(self, answer: str, calls: list[dict[str, Any]] | None = None) -> None:
        """Store the real answer of the current turn and its tool calls."""
        self.answers.append(answer)
        self.calls.append(list(calls or []))


@dataclass
class Workload:
    """Base of the workload generators; subclasses are dataclasses of sizes."""

    name: ClassVar[str] = ""
    default_api: ClassVar[str] = "chat"
    summary: ClassVar[str] = ""

    def sessions(self, corpus: Corpus) -> list[Session]:
        """Build the sessions from `corpus` (deterministic for the corpus seed)."""
        raise NotImplementedError

    def num_requests(self) -> int:
        """How many requests a full run sends."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """The size parameters as a dict."""
        return dataclasses.asdict(self)


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
        head = "You are a helpful assistant for Python documentation. Reference notes:\n\n"
        system = head + corpus.passage(self.system_tokens - corpus.counter.count(head))
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


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (MultiTurn, SharedPreamble, FewShot, AgentLoop, UniquePrompts, Spike)
}
SUITE_WORKLOADS = ("multi_turn", "rag", "few_shot", "agent", "unique")
"""The workloads `bench --suite` runs by default (cache on vs off)."""


def make_workload(name: str, params: dict[str, str] | None = None) -> Workload:
    """A workload by name with some size parameters overridden (`{"turns": "6"}`)."""
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
