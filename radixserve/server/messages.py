"""OpenAI chat messages: one pydantic model checked per role, and its JSON schema."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator


class Strict(BaseModel):
    """Base of the wire models. Unknown fields are ignored (OpenAI clients send fields we do
    not use; the known ones that change the output are all declared, see docs/server.md);
    known fields are typed strictly: "10" is not an int, 1 is not a bool, NaN is not a
    temperature."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# Content part types OpenAI defines that this text-only server cannot read.
_MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "file": "file"}
# Which content part types each role may send (OpenAI's message types); others: text only.
_PART_TYPES = {"assistant": ("text", "refusal")}


class ContentPart(Strict):
    """One part of a message's content list; text (and an assistant's refusal) only."""

    type: str
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _readable(self) -> ContentPart:
        if self.type in _MEDIA_PARTS:
            raise ValueError(
                f"{_MEDIA_PARTS[self.type]} content parts ('{self.type}') are not supported: "
                "this model reads text only; send {'type': 'text', 'text': ...} parts"
            )
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs a string 'text'")
        if self.type == "refusal" and self.refusal is None:
            raise ValueError("a refusal content part needs a string 'refusal'")
        if self.type not in ("text", "refusal"):
            raise ValueError(f"unknown content part type '{self.type}'; expected 'text'")
        return self


class FunctionCall(Strict):
    """The function an assistant's tool call names, with its JSON arguments as a string."""

    name: str
    arguments: str


class ToolCall(Strict):
    """One entry of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    """One chat message, checked per role as OpenAI's API does (see docs/server.md)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        # Checked here so a bad part gets its own message, not one error per union member.
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("content must be a string or a list of content parts")
        parts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict):
                raise ValueError(f"content[{j}] must be an object with a 'type'")
            try:
                parts.append(ContentPart.model_validate(part))
            except ValidationError as e:
                inner = "".join(f".{p}" for p in e.errors(include_url=False)[0].get("loc", ()))
                raise ValueError(f"content[{j}]{inner}: {first_message(e)}") from None
        return parts

    @model_validator(mode="after")
    def _per_role(self) -> ChatMessage:
        role = self.role
        if self.content is None and not (role == "assistant" and self.tool_calls):
            raise ValueError(
                f"'content' is required in {a_role(role)} message (it may be null only in an "
                "assistant message that carries tool_calls)"
            )
        if isinstance(self.content, list):
            allowed = _PART_TYPES.get(role, ("text",))
            for part in self.content:
                if part.type not in allowed:
                    raise ValueError(
                        f"{a_role(role).capitalize()} message cannot hold '{part.type}' parts"
                    )
        if role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs 'tool_call_id' (a string)")
        if role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"'tool_call_id' belongs in tool messages, not {role} messages")
        if role != "assistant" and self.tool_calls is not None:
            raise ValueError(f"'tool_calls' belongs in assistant messages, not {role} messages")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as the tokenizer's chat template takes it: role, text content, and
        the tool fields (engine/tool_calls.py renders them)."""
        if isinstance(self.content, list):
            text = "".join((p.text if p.type == "text" else p.refusal) or "" for p in self.content)
        else:
            text = self.content or ""
        out: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def message_schema() -> dict[str, Any]:
    """JSON schema of one message, one variant per role rule of `ChatMessage` (the OpenAPI
    document shows it; the fuzz tests hold the validators to it)."""

    def part(kind: str) -> dict[str, Any]:
        props = {"type": {"const": kind}, kind: {"type": "string"}}
        return {"type": "object", "properties": props, "required": ["type", kind]}

    def content(*kinds: str) -> dict[str, Any]:
        items = part(kinds[0]) if len(kinds) == 1 else {"anyOf": [part(k) for k in kinds]}
        return {"anyOf": [{"type": "string"}, {"type": "array", "items": items}]}

    call = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
                "required": ["name", "arguments"],
            },
        },
        "required": ["id", "function"],
    }
    null, text = {"type": "null"}, {"anyOf": [{"type": "string"}, {"type": "null"}]}

    def variant(roles: list[str], required: list[str], **props: Any) -> dict[str, Any]:
        base = {"name": text, "tool_call_id": null, "tool_calls": null}
        properties = {"role": {"enum": roles}, **base, **props}
        return {"type": "object", "properties": properties, "required": ["role", *required]}

    calls = {"type": "array", "items": call}
    return {
        "title": "ChatMessage",
        "anyOf": [
            variant(["system", "developer", "user"], ["content"], content=content("text")),
            variant(
                ["tool"],
                ["content", "tool_call_id"],
                content=content("text"),
                tool_call_id={"type": "string"},
            ),
            variant(
                ["assistant"],
                ["content"],
                content=content("text", "refusal"),
                tool_calls={"anyOf": [calls, null]},
            ),
            variant(
                ["assistant"], ["tool_calls"], content=null, tool_calls={**calls, "minItems": 1}
            ),
        ],
    }


def a_role(role: str) -> str:
    """'a user' / 'an assistant'."""
    return f"an {role}" if role[0] in "aeiou" else f"a {role}"


def first_message(e: ValidationError) -> str:
    """The first error of a pydantic ValidationError, as a client-readable sentence."""
    msg = str(e.errors(include_url=False)[0].get("msg", "invalid value"))
    return msg.removeprefix("Value error, ")
