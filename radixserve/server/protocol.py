"""OpenAI wire format: request bodies (pydantic, strict types) and how they are parsed."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, WithJsonSchema, field_validator, model_validator
from starlette.requests import Request

from radixserve.engine.params import MAX_LOGPROBS, MAX_N
from radixserve.server.errors import APIError
from radixserve.server.messages import ChatMessage, Strict, first_message, message_schema

MAX_BODY_BYTES = 8 * 1024 * 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(Strict):
    """`stream_options` of a streaming request."""

    include_usage: bool = False


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


class FunctionDef(Strict):
    """A tool's function: its name, what it does, and its arguments' JSON schema."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # honoured always: constrained calls match the schema


class Tool(Strict):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    """The function a named `tool_choice` forces."""

    name: str


class NamedToolChoice(Strict):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    """`response_format.json_schema`."""

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # honoured always: the output is constrained to the schema


class ResponseFormat(Strict):
    """`response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        return self


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


def _unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param} is not supported: {why}", param=param)


class _SamplingRequest(Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (docs/server.md has the
    table of every OpenAI field and what this server does with it)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None
    # radixserve and vLLM extras (pass them with the openai client's `extra_body`)
    top_k: int | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # vLLM's: on a decode worker, the prefill worker to take the prompt's K/V from
    # ({"prefill_url": URL}, set by `radixserve route --pd-disaggregation`); else unused
    kv_transfer_params: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("stop must be a string or a list of strings")

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids as strings, not {key!r}")
        return v

    def unsupported(self) -> APIError | None:
        """The first field set to something this server cannot do, as a 400 naming it."""
        if self.stream and self.best_of_value() > self.n:
            return APIError(400, "best_of > n cannot be streamed", param="best_of")
        return None

    def best_of_value(self) -> int:
        """How many choices are drawn (best_of where the API has it)."""
        return self.n

    def bias(self) -> dict[int, float]:
        """logit_bias with integer token ids."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    @property
    def include_usage(self) -> bool:
        """Whether a streaming response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[Annotated[ChatMessage, WithJsonSchema(message_schema())]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted because they do not change the output (see docs/server.md):
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None  # also marks the session, like `user`
    safety_identifier: str | None = None
    # Accepted only at values that ask for nothing this server cannot do:
    store: Annotated[bool | None, _only(False, None)] = None
    service_tier: Annotated[str | None, _only("auto", "default", None)] = None
    modalities: Annotated[list[str] | None, _only(["text"], None)] = None
    audio: Annotated[dict[str, Any] | None, _only(None)] = None
    prediction: Annotated[dict[str, Any] | None, _only(None)] = None
    reasoning_effort: Annotated[str | None, _only(None)] = None
    verbosity: Annotated[str | None, _only(None)] = None
    web_search_options: Annotated[dict[str, Any] | None, _only(None)] = None
    functions: Annotated[list[dict[str, Any]] | None, _only(None)] = None
    function_call: Annotated[str | dict[str, Any] | None, _only(None)] = None

    def unsupported(self) -> APIError | None:
        """As the base class, plus the chat fields."""
        if self.top_logprobs is not None and not self.logprobs:
            return APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.tool_choice is not None and not self.tools:
            return APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools:
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                why = f"tool_choice names {name!r}, which is not in tools"
                return APIError(400, why, param="tool_choice")
        refused = (
            ("store", self.store, "completions are not stored"),
            ("service_tier", self.service_tier not in (None, "auto", "default"), "one tier only"),
            ("modalities", self.modalities not in (None, ["text"]), "text output only"),
            ("audio", self.audio is not None, "text output only"),
            ("prediction", self.prediction is not None, "no predicted outputs"),
            ("reasoning_effort", self.reasoning_effort is not None, "not a reasoning model"),
            ("verbosity", self.verbosity is not None, "not a reasoning model"),
            ("web_search_options", self.web_search_options is not None, "no web search"),
            ("functions", self.functions is not None, "deprecated; send `tools`"),
            ("function_call", self.function_call is not None, "deprecated; send `tool_choice`"),
        )
        for param, bad, why in refused:
            if bad:
                return _unsupported(param, why)
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for `Tokenizer.apply_chat_template`."""
        return [m.template_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """`tools` as plain dicts (None without tools)."""
        if not self.tools:
            return None
        return [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]


class CompletionRequest(_SamplingRequest):
    """Body of POST /v1/completions; `prompt` is text, token ids, or a list of one of those."""

    prompt: Annotated[str | list[int], WithJsonSchema(_PROMPT_SCHEMA)]
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
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
        """As the base class, plus best_of and suffix."""
        if self.best_of is not None and self.best_of < self.n:
            return APIError(400, "best_of must be >= n", param="best_of")
        if self.suffix:
            return _unsupported("suffix", "no fill-in-the-middle")
        return super().unsupported()

    def best_of_value(self) -> int:
        """best_of, or n when it is not set."""
        return self.best_of or self.n

    def requested_max_tokens(self) -> int | None:
        """max_tokens as sent (None when absent)."""
        return self.max_tokens


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


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
    return APIError(400, f"invalid '{where}': {first_message(e)}", param=param)
