"""Chat completion responses: each choice's message (content, tool calls, log-probs), whole
or as server-sent-event deltas shaped as OpenAI sends them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from radixserve.engine.outputs import RequestOutput
from radixserve.engine.tokenizer import Tokenizer
from radixserve.engine.tool_calls import ParsedCall, ToolCallStream, parse_calls
from radixserve.server.bridge import OutputStream
from radixserve.server.logprobs import chat_entries
from radixserve.server.protocol import sse
from radixserve.server.usage import failure, usage


def shown_tokens(out: RequestOutput) -> int:
    """Output tokens that carry text: all but a stop token that ended the output."""
    n = len(out.token_ids)
    return n - 1 if isinstance(out.stop_reason, int) and n else n


class ChatResponder:
    """Shapes one chat request's outputs. `tool_names`: the functions whose calls are
    parsed out of the text (empty: the output is content); `top_logprobs`: None without
    log-probs; `constrained_calls`: the output is grammar-constrained to calls (tool_choice
    required or named), so a streamed call's arguments go out as they are decoded."""

    def __init__(
        self,
        tok: Tokenizer,
        base: dict[str, Any],
        tool_names: list[str],
        top_logprobs: int | None,
        constrained_calls: bool = False,
    ) -> None:
        self.tok = tok
        self.base = base
        self.tool_names = tool_names
        self.top_logprobs = top_logprobs
        self.constrained_calls = constrained_calls

    def choice(self, out: RequestOutput) -> dict[str, Any]:
        """One finished choice of a non-streamed response."""
        content: str | None = out.text
        calls: list[ParsedCall] = []
        if self.tool_names:
            content, calls = parse_calls(out.text, self.tool_names)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [_call(c) for c in calls]
        reason = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        return {
            "index": out.index,
            "message": message,
            "logprobs": self._logprobs(out, 0, shown_tokens(out)),
            "finish_reason": reason,
        }

    def _logprobs(self, out: RequestOutput, start: int, stop: int) -> dict[str, Any] | None:
        if self.top_logprobs is None or out.logprobs is None:
            return None
        entries = out.logprobs[start:stop]
        return {"content": chat_entries(self.tok, entries, self.top_logprobs), "refusal": None}

    async def events(self, stream: OutputStream, include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE body: a role delta per choice, content / tool-call deltas as they come,
        a finish chunk per choice, the usage chunk if asked, then [DONE]."""
        extra = {"usage": None} if include_usage else {}
        n = stream.num_choices
        parsers = {i: ToolCallStream(self.tool_names, self.constrained_calls) for i in range(n)}
        sent_tokens = dict.fromkeys(range(n), 0)
        calls_sent = dict.fromkeys(range(n), 0)

        def chunk(index: int, delta: dict[str, Any], **fields: Any) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            return sse({**self.base, "choices": [{**choice, **fields}], **extra})

        try:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for out in stream:
                if out.finished and (err := failure(out)) is not None:
                    yield sse(err.body())
                    break
                i = out.index
                upto = shown_tokens(out) if out.finished else len(out.token_ids)
                logprobs = self._logprobs(out, sent_tokens[i], upto)
                sent_tokens[i] = max(sent_tokens[i], upto)
                pieces = self._deltas(parsers[i], out, calls_sent, i)
                if logprobs is not None and logprobs["content"] and not pieces:
                    pieces = [{"content": ""}]
                for k, delta in enumerate(pieces):
                    yield chunk(i, delta, logprobs=logprobs if k == 0 else None)
                if out.finished:
                    called = calls_sent[i] and out.finish_reason == "stop"
                    yield chunk(i, {}, finish_reason="tool_calls" if called else out.finish_reason)
            if include_usage and stream.finished and failure(stream.final) is None:
                yield sse({**self.base, "choices": [], "usage": usage(stream.finals)})
            yield b"data: [DONE]\n\n"
        finally:
            stream.close()

    def _deltas(
        self, parser: ToolCallStream, out: RequestOutput, calls_sent: dict[int, int], i: int
    ) -> list[dict[str, Any]]:
        if not self.tool_names:
            return [{"content": out.new_text}] if out.new_text else []
        events = parser.feed(out.new_text) if out.new_text else []
        if out.finished:
            events += parser.finish()
        deltas: list[dict[str, Any]] = []
        for e in events:
            if e.arguments:  # more of the arguments of the call started last
                args = {"arguments": e.arguments}
                deltas.append({"tool_calls": [{"index": calls_sent[i] - 1, "function": args}]})
            started = e.call or e.start
            if started is None:
                if e.content:
                    deltas.append({"content": e.content})
                continue
            k = calls_sent[i]
            calls_sent[i] += 1
            # As OpenAI streams a call: its id and name (empty arguments), then arguments.
            name = {"name": started.name, "arguments": ""}
            head = {"index": k, "id": started.id, "type": "function", "function": name}
            deltas.append({"tool_calls": [head]})
            if e.call is not None:
                args = {"arguments": e.call.arguments}
                deltas.append({"tool_calls": [{"index": k, "function": args}]})
        return deltas


def _call(c: ParsedCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
