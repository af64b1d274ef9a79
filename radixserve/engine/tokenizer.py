"""Tokenizer, chat template and incremental detokenization over HF `transformers`."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixserve.engine.tool_calls import template_messages
from radixserve.errors import ConfigError, InvalidRequestError, ModelNotFoundError

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")


def _tokenizer_class(path: Path) -> str | None:
    """tokenizer_config.json's `tokenizer_class` in directory `path`, if it names one."""
    try:
        value = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> token ids for one model, with its chat template and stop tokens."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        # A fast tokenizer's Rust core, called directly: the same ids without transformers'
        # per-call wrapping (a 2,048-token prompt: 2.4-2.9 instead of 2.8-4.0 ms).
        self._backend: Any = getattr(hf_tokenizer, "backend_tokenizer", None)
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        template = getattr(hf_tokenizer, "chat_template", None)
        source = " ".join(template.values()) if isinstance(template, dict) else str(template)
        # Whether the template renders `tools` and `tool_calls` itself (else tool_calls.py
        # writes them as text in the Hermes format).
        self.template_takes_tools = "tools" in source and "tool_calls" in source
        self._byte_level = _is_byte_level(self._backend)
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token id -> (text, bytes), lazily

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load tokenizer.json / tokenizer_config.json (and chat template) from a directory;
        `chat_template` (a file or the template itself, `load_chat_template`) replaces the
        directory's template."""
        import transformers

        # A tokenizer.json-only tokenizer (what a GGUF's export writes) loads through its
        # class, imported from its module: AutoTokenizer would first import every model's
        # configuration to find that same class, and the package's attribute would first map
        # every model's modules (the default model: 0.2 s against 1.4 and 0.7).
        loader: Any
        if _tokenizer_class(Path(path)) == "TokenizersBackend":
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            loader = TokenizersBackend
        else:
            loader = transformers.AutoTokenizer
        try:
            hf = loader.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ModelNotFoundError(f"cannot load a tokenizer from {path}: {e}") from e
        if chat_template is not None:
            hf.chat_template = load_chat_template(chat_template)
        return cls(hf)

    @property
    def has_chat_template(self) -> bool:
        """Whether chats can be rendered (the tokenizer has a template, or one was given)."""
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without adding special tokens."""
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def decode_batch(self, token_lists: list[list[int]]) -> list[str]:
        """Texts of many token id lists in one call, special tokens kept (for displays)."""
        return [str(t) for t in self.hf.batch_decode(token_lists, skip_special_tokens=False)]

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """One token on its own: its text (decoded alone, special tokens kept; a piece of a
        UTF-8 character shows as U+FFFD) and its exact bytes (what OpenAI's logprobs
        `bytes` carry)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            text = self.decode([token_id], skip_special_tokens=False)
            raw = self.hf.convert_ids_to_tokens(token_id)
            if self._byte_level and isinstance(raw, str) and raw not in self.hf.all_special_tokens:
                data = bytes(_BYTE_OF.get(ch, 0) for ch in raw)
            elif isinstance(raw, str) and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", raw):
                data = bytes([int(raw[3:5], 16)])  # SentencePiece byte fallback
            else:
                data = text.encode()
            piece = (text, data)
            self._pieces[token_id] = piece
        return piece

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a chat rendered through the model's template, with `tools` (OpenAI
        tool objects) and the messages' `tool_calls` (see engine/tool_calls.py); validates
        the messages."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", "messages")
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template, so it cannot render chat messages: send "
                "a prompt to /v1/completions, or start radixserve with --chat-template FILE",
                "messages",
            )
        clean = [_clean_message(i, m) for i, m in enumerate(messages)]
        native = self.template_takes_tools
        rendered = template_messages(clean, tools, native)
        extra = {"tools": list(tools)} if tools and native else {}
        try:
            text = self.hf.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )
        except Exception as e:  # a template may raise on unexpected role orders
            raise InvalidRequestError(f"chat template failed: {e}", "messages") from e
        return self.encode(str(text))


def load_chat_template(value: str) -> str:
    """The Jinja template `--chat-template` names: the contents of the file `value`, or
    `value` itself when it is a template (it holds "{{" or "{%", as vLLM accepts). Raises
    ConfigError for anything else."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template {value}: cannot read it ({e})") from None
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template {value}: no such file (nor a Jinja template)")


def _clean_message(i: int, m: Any) -> dict[str, Any]:
    """One message with its content as a string (text parts joined), its role checked, and
    its tool fields kept."""
    if not isinstance(m, dict):
        raise InvalidRequestError(f"messages[{i}] must be an object", "messages")
    role, content = m.get("role"), m.get("content")
    if role not in VALID_ROLES:
        raise InvalidRequestError(
            f"messages[{i}].role must be one of {', '.join(VALID_ROLES)}", "messages"
        )
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError(
                    f"messages[{i}].content: only text parts are supported", "messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(
                    f"messages[{i}].content part text must be a string", "messages"
                )
            parts.append(text)
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidRequestError(f"messages[{i}].content must be a string", "messages")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    calls = m.get("tool_calls")
    if calls:
        for c in calls:
            fn = c.get("function") if isinstance(c, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                raise InvalidRequestError(
                    f"messages[{i}].tool_calls: each needs function.name and .arguments",
                    "messages",
                )
        out["tool_calls"] = list(calls)
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, reversed: the character a byte-level BPE
    vocabulary writes for each byte value."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF = _byte_level_map()


def _is_byte_level(backend: Any) -> bool:
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        # A few prompt tokens of context so leading-space handling matches a full decode.
        tail = list(prompt_token_ids[-4:])
        self.ids: list[int] = tail
        self.prefix_offset = 0
        self.read_offset = len(tail)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
