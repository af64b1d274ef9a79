"""Text completion responses: each choice's text (after the prompt when `echo`) and its
log-probs (the prompt's too when `echo`), whole or as server-sent-event deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from radixserve.engine.outputs import RequestOutput
from radixserve.engine.tokenizer import Tokenizer
from radixserve.server.bridge import OutputStream
from radixserve.server.chat import shown_tokens
from radixserve.server.logprobs import CompletionLogprobs
from radixserve.server.protocol import sse
from radixserve.server.usage import failure, usage


class CompletionResponder:
    """Shapes one completion request's outputs. `echo_text`: the prompt's text when
    `echo`, else None; `logprobs`: None without log-probs."""

    def __init__(
        self, tok: Tokenizer, base: dict[str, Any], echo_text: str | None, logprobs: int | None
    ) -> None:
        self.tok = tok
        self.base = base
        self.echo_text = echo_text
        self.logprobs = logprobs

    def choice(self, out: RequestOutput) -> dict[str, Any]:
        """One finished choice of a non-streamed response."""
        lp = None
        if self.logprobs is not None:
            builder = CompletionLogprobs(self.tok, self.logprobs)
            lp = self._merge(self._prompt_part(builder, out), self._part(builder, out, 0))
        return {
            "index": out.index,
            "text": (self.echo_text or "") + out.text,
            "logprobs": lp,
            "finish_reason": out.finish_reason,
        }

    def _prompt_part(self, builder: CompletionLogprobs, out: RequestOutput) -> dict[str, Any]:
        if self.echo_text is None:
            return {}
        scores = out.prompt_logprobs or []
        entries = [None, *scores][: len(out.prompt_token_ids)]
        entries += [None] * (len(out.prompt_token_ids) - len(entries))
        return builder.build(entries, out.prompt_token_ids)

    def _part(self, builder: CompletionLogprobs, out: RequestOutput, start: int) -> dict[str, Any]:
        upto = shown_tokens(out) if out.finished else len(out.token_ids)
        entries = (out.logprobs or [])[start:upto]
        return builder.build(entries, out.token_ids[start : start + len(entries)])

    @staticmethod
    def _merge(*parts: dict[str, Any]) -> dict[str, Any]:
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {k: [x for p in parts for x in p.get(k, [])] for k in keys}

    async def events(self, stream: OutputStream, include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE body: text deltas per choice (the prompt first when `echo`), a finish
        chunk per choice, the usage chunk if asked, then [DONE]."""
        extra = {"usage": None} if include_usage else {}
        n = stream.num_choices
        builders = {i: CompletionLogprobs(self.tok, self.logprobs or 0) for i in range(n)}
        sent = dict.fromkeys(range(n), 0)
        echoed: set[int] = set()

        def chunk(out: RequestOutput, text: str, lp: dict[str, Any] | None) -> bytes:
            reason = out.finish_reason if out.finished else None
            choice = {"index": out.index, "text": text, "logprobs": lp, "finish_reason": reason}
            return sse({**self.base, "choices": [choice], **extra})

        try:
            async for out in stream:
                if out.finished and (err := failure(out)) is not None:
                    yield sse(err.body())
                    break
                i, builder = out.index, builders[out.index]
                text, parts = out.new_text, []
                if self.echo_text is not None and i not in echoed:
                    echoed.add(i)
                    text = self.echo_text + text
                    if self.logprobs is not None:
                        parts.append(self._prompt_part(builder, out))
                lp = None
                if self.logprobs is not None:
                    parts.append(self._part(builder, out, sent[i]))
                    lp = self._merge(*parts)
                    sent[i] += len(parts[-1].get("tokens", []))
                if text or out.finished or (lp and lp["tokens"]):
                    yield chunk(out, text, lp)
            if include_usage and stream.finished and failure(stream.final) is None:
                yield sse({**self.base, "choices": [], "usage": usage(stream.finals)})
            yield b"data: [DONE]\n\n"
        finally:
            stream.close()
