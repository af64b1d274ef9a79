"""OpenAI wire format: request bodies (pydantic, strict types) and how they are parsed."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from starlette.requests import Request

from radixserve.server.errors import APIError

MAX_BODY_BYTES = 8 * 1024 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    # Unknown fields are ignored (OpenAI clients send fields we do not use); known fields are
    # typed strictly: "10" is not an int, 1 is not a bool, NaN is not a temperature.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    """`stream_options` of a streaming request."""

    include_usage: bool = False


# Content part types OpenAI defines that this text-only server cannot read.
_MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "file": "file"}
# Which content part types each role may send (OpenAI's message types); others: text only.
_PART_TYPES = {"assistant": ("text", "refusal")}


class ContentPart(_Strict):
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


class FunctionCall(_Strict):
    """The function an assistant's tool call names, with its JSON arguments as a string."""

    name: str
    arguments: str


class ToolCall(_Strict):
    """One entry of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
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
                raise ValueError(f"content[{j}]{inner}: {_first_message(e)}") from None
        return parts

    @model_validator(mode="after")
    def _per_role(self) -> ChatMessage:
        role = self.role
        if self.content is None and not (role == "assistant" and self.tool_calls):
            raise ValueError(
                f"'content' is required in {_a(role)} message (it may be null only in an "
                "assistant message that carries tool_calls)"
            )
        if isinstance(self.content, list):
            allowed = _PART_TYPES.get(role, ("text",))
            for part in self.content:
                if part.type not in allowed:
                    raise ValueError(
                        f"{_a(role).capitalize()} message cannot hold '{part.type}' parts"
                    )
        if role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs 'tool_call_id' (a string)")
        if role != "tool" and self.tool_call_id is not None:
            raise ValueError(f"'tool_call_id' belongs in tool messages, not {role} messages")
        if role != "assistant" and self.tool_calls is not None:
            raise ValueError(f"'tool_calls' belongs in assistant messages, not {role} messages")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as the tokenizer's chat template takes it: role and text content."""
        if isinstance(self.content, list):
            text = "".join((p.text if p.type == "text" else p.refusal) or "" for p in self.content)
        else:
            text = self.content or ""
        return {"role": self.role, "content": text}


def _message_schema() -> dict[str, Any]:
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


_ONE_PROMPT: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    ]
}
# A prompt as `CompletionRequest._prompt_shape` accepts it (token ids below the vocabulary
# size; the engine answers larger ones with a 400).
_PROMPT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        *_ONE_PROMPT["anyOf"],
        {"type": "array", "items": _ONE_PROMPT, "minItems": 1, "maxItems": 1},
    ]
}


def _only(*values: Any) -> WithJsonSchema:
    """Schema of an OpenAI parameter accepted only at these (default) values: `unsupported()`
    answers any other value with a 400, and the OpenAPI document says so."""
    return WithJsonSchema({"enum": list(values)})


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: Annotated[int, _only(1)] = Field(default=1, ge=1)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float | None, _only(0, None)] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Annotated[float | None, _only(0, None)] = Field(default=None, ge=-2, le=2)
    logit_bias: Annotated[dict[str, float] | None, _only({}, None)] = None
    # radixserve extras (pass them with the openai client's `extra_body`)
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("stop must be a string or a list of strings")

    def unsupported(self) -> APIError | None:
        """The first accepted-but-unsupported parameter set to a non-default value, if any."""
        if self.n != 1:
            return APIError(400, "only n=1 is supported", param="n")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return APIError(400, f"{param} is not supported; leave it at 0", param=param)
        if self.logit_bias:
            return APIError(400, "logit_bias is not supported", param="logit_bias")
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a streaming response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[Annotated[ChatMessage, WithJsonSchema(_message_schema())]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Annotated[bool | None, _only(False, None)] = None
    top_logprobs: Annotated[int | None, _only(0, None)] = None

    def unsupported(self) -> APIError | None:
        """As the base class, plus logprobs."""
        if self.logprobs or self.top_logprobs:
            return APIError(400, "logprobs are not supported", param="logprobs")
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for `Tokenizer.apply_chat_template`."""
        return [m.template_dict() for m in self.messages]


class CompletionRequest(_SamplingRequest):
    """Body of POST /v1/completions; `prompt` is text, token ids, or a list of one of those."""

    prompt: Annotated[str | list[int], WithJsonSchema(_PROMPT_SCHEMA)]
    echo: Annotated[bool, _only(False)] = False
    best_of: Annotated[int | None, _only(1, None)] = None
    logprobs: Annotated[int | None, _only(0, None)] = None
    suffix: Annotated[str | None, _only("", None)] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one prompt
        elif isinstance(v, list) and v and isinstance(v[0], (str, list)):
            raise ValueError("only one prompt per request is supported")
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt must not be empty")
            return v
        if isinstance(v, list) and v and all(_is_int(t) for t in v):
            return v
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        raise ValueError("prompt must be a string or a list of token ids")

    def unsupported(self) -> APIError | None:
        """As the base class, plus echo, best_of, logprobs and suffix."""
        if self.echo:
            return APIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            return APIError(400, "only best_of=1 is supported", param="best_of")
        if self.logprobs:
            return APIError(400, "logprobs are not supported", param="logprobs")
        if self.suffix:
            return APIError(400, "suffix is not supported", param="suffix")
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        """max_tokens as sent (None when absent)."""
        return self.max_tokens


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def _a(role: str) -> str:
    return f"an {role}" if role[0] in "aeiou" else f"a {role}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


async def read_json_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """The request body as JSON: 413 over `max_bytes`, 400 for non-UTF-8 or malformed JSON."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body is larger than {max_bytes} bytes", code="too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body is larger than {max_bytes} bytes", code="too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {_short(e)}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _short(e: BaseException) -> str:
    return str(e)[:200] or type(e).__name__


def parse_body(model: type[_SamplingRequest], body: Any) -> Any:
    """Validate a JSON value against a request model; pydantic errors become one 400."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    """An APIError naming the first invalid field, in words a client can act on."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return APIError(400, f"invalid '{where}': {_first_message(e)}", param=param)


def _first_message(e: ValidationError) -> str:
    msg = str(e.errors(include_url=False)[0].get("msg", "invalid value"))
    return msg.removeprefix("Value error, ")
