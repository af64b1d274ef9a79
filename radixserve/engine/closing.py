"""Budget-aware closing of JSON outputs: when a JSON-constrained request (response_format,
structured_outputs json, a forced tool call) is about to run out of max_tokens, its allowed
tokens are narrowed to those that close what is open, so it ends as valid JSON instead of
being cut off (finish_reason "length") in the middle of a string a small model keeps
repeating.

Inside a string the preferred tokens are those that end it (text, one `"`, then nothing
but `}`, `]` or spaces); outside, those that are only `}`, `]` and spaces, and EOS. They are
preferred only among the tokens the grammar allows, and only when the grammar allows one of
them, so the output always stays valid (a missing required property is still written:
the grammar allows nothing that closes before it).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import torch

CLOSING_MARGIN = 24  # tokens of max_tokens left when closing starts (at most half)
_ENDS_STRING = re.compile(r'[^"\\]*"[\]}\s]*')
_CLOSES = re.compile(r"\s*[\]}]+\s*")


def closing_starts(max_tokens: int, num_output: int) -> bool:
    """Whether an output of `num_output` tokens out of `max_tokens` must start closing."""
    return max_tokens - num_output <= min(CLOSING_MARGIN, max_tokens // 2)


def in_json_string(text: str) -> bool:
    """Whether `text`, the JSON written so far (tags around it have no quotes), ends inside
    a string."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif inside and ch == "\\":
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


class JsonCloser:
    """The closing token sets of one vocabulary, as bitmask rows like a grammar's."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Collection[int]) -> None:
        words = (vocab_size + 31) // 32
        quote = torch.zeros(words * 32, dtype=torch.bool)
        close = torch.zeros(words * 32, dtype=torch.bool)
        # Raw vocabulary strings: byte-level BPE writes a space as "Ġ", SentencePiece as
        # "▁"; both write `"`, `}` and `]` as themselves.
        ids = list(range(min(vocab_size, len(hf_tokenizer))))
        for i, piece in zip(ids, hf_tokenizer.convert_ids_to_tokens(ids), strict=True):
            if isinstance(piece, str):
                text = piece.replace("Ġ", " ").replace("▁", " ").replace("Ċ", "\n")
                quote[i] = _ENDS_STRING.fullmatch(text) is not None
                close[i] = _CLOSES.fullmatch(text) is not None
        for e in eos_ids:
            if e < vocab_size:
                close[e] = True
        self.quote = _pack(quote)
        self.close = _pack(close)

    def steer(self, allowed: torch.Tensor, text: str) -> None:
        """Narrow bitmask row `allowed` (in place) to the closing tokens for `text`, when
        the grammar allows any of them."""
        prefer = self.quote if in_json_string(text) else self.close
        narrowed = allowed & prefer
        if bool(narrowed.any()):
            allowed.copy_(narrowed)


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """bool [32 w] -> int32 [w], bit j of word k = bits[32 k + j]."""
    weights = (2 ** torch.arange(32, dtype=torch.int64))[None, :]
    words = (bits.view(-1, 32).long() * weights).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
