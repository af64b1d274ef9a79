"""What a workload is made of: the request to send (`RequestSpec`), the session that scripts a
conversation's turns and fills in the server's real answers (`Session`), and the base of the
workload generators (`Workload`). The generators themselves live in workloads.py and
repeat_workloads.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixserve.bench.corpus import Corpus

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


def docs_assistant_system(corpus: Corpus, tokens: int) -> str:
    """The chat workloads' shared system prompt: a Python-docs assistant and `tokens` tokens
    of reference notes from `corpus`."""
    head = "You are a helpful assistant for Python documentation. Reference notes:\n\n"
    return head + corpus.passage(tokens - corpus.counter.count(head))
