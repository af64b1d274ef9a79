"""What the router reads from a request body: optional normalisation and the prompt's token ids."""

from __future__ import annotations

import copy
from typing import Any, Protocol


class PromptTokenizer(Protocol):
    """The slice of `radixserve.engine.tokenizer.Tokenizer` the router needs."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Any) -> list[int]: ...


def _norm_text(text: str, strip: bool) -> str:
    text = text.replace("\r\n", "\n")
    return text.strip() if strip else text


def normalize_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """A copy of `body` with `\\r\\n` -> `\\n` everywhere and message contents stripped.

    Chat message contents (strings and text parts) are stripped of leading/trailing whitespace;
    completion prompts only get their line endings normalised, since a trailing space there can
    be meaningful ("Answer: ").
    """
    out = copy.deepcopy(body)
    if chat:
        for m in out.get("messages") or []:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, str):
                m["content"] = _norm_text(content, strip=True)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        part["text"] = _norm_text(part["text"], strip=True)
    else:
        prompt = out.get("prompt")
        if isinstance(prompt, str):
            out["prompt"] = _norm_text(prompt, strip=False)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            out["prompt"] = [_norm_text(p, strip=False) for p in prompt]
    return out


def prompt_token_ids(body: dict[str, Any], chat: bool, tokenizer: PromptTokenizer) -> list[int]:
    """The token ids the worker will see for this request (the first prompt of a batch).

    Raises whatever the tokenizer raises on a malformed body; the caller then routes by load
    and lets the worker produce the proper 400.
    """
    if chat:
        return list(tokenizer.apply_chat_template(body["messages"]))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return [int(t) for t in prompt]
        if isinstance(first, str):
            return tokenizer.encode(first)
        if isinstance(first, list):
            return [int(t) for t in first]
    raise ValueError("no prompt in the request")


def namespace_of(body: dict[str, Any]) -> str | None:
    """The cache namespace of a request: its `cache_salt`, or None (shared)."""
    salt = body.get("cache_salt")
    return str(salt) if salt is not None else None
