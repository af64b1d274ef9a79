"""Log-probs in OpenAI's two shapes: chat (`logprobs.content`: token, logprob, bytes,
top_logprobs) and completions (parallel lists: tokens, token_logprobs, top_logprobs,
text_offset)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.engine.tokenizer import Tokenizer
from radixserve.model.sampling import TokenLogprobs


def chat_entries(
    tok: Tokenizer, entries: Sequence[TokenLogprobs], num_top: int
) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` items for `entries`."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, data = tok.token_piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(data)}

    return [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top[:num_top]]}
        for e in entries
    ]


class CompletionLogprobs:
    """Builds a completion choice's `logprobs` object piece by piece (streaming sends each
    chunk's pieces; `text_offset` counts on from where the last chunk ended)."""

    def __init__(self, tok: Tokenizer, num_top: int, offset: int = 0) -> None:
        self.tok = tok
        self.num_top = num_top
        self.offset = offset

    def build(self, entries: Sequence[TokenLogprobs | None], ids: Sequence[int]) -> dict[str, Any]:
        """The object for tokens `ids` (entry None: no log-prob, as for a prompt's first
        token)."""
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, e in zip(ids, entries, strict=True):
            text, _ = self.tok.token_piece(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(e.logprob)
            top = {self.tok.token_piece(t)[0]: v for t, v in e.top[: self.num_top]}
            top.setdefault(text, e.logprob)  # OpenAI: the chosen token is always listed
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
