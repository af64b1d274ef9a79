"""The server's OpenAPI document (GET /openapi.json): request bodies and every response shape.

The routes read their bodies themselves (to answer malformed JSON with OpenAI errors), so
FastAPI cannot see the models; this module describes them from the same pydantic models the
routes validate with, and the response models below mirror what `serving.py` writes. The
schemathesis fuzz tests check live responses against this document.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    """The inside of an OpenAI error body."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    """Speculative decoding's drafted tokens, in OpenAI's Predicted Outputs fields (present
    when the request had drafts)."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


class FunctionCallOut(BaseModel):
    """The function a generated tool call names, with its JSON arguments as text."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """One generated tool call."""

    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    """The generated message of a chat completion (content is null when it is only tool
    calls; `tool_calls` is absent when there are none)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    """One of a token's most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A generated token's log-prob, with its `top_logprobs` alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """`choices[].logprobs` of a chat completion (with `logprobs: true`)."""

    content: list[TokenLogprob] | None
    refusal: None


_FINISH = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: _FINISH


class ChatCompletion(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    """`choices[].logprobs` of a text completion (with `logprobs: N`); the prompt's tokens
    first with `echo` (the very first one without a log-prob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One choice of a text completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    """A non-streamed text completion."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    """One served model."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    """GET /health while the engine runs."""

    status: Literal["ok"]


_MODELS: list[type[BaseModel]] = [
    ErrorResponse,
    ChatCompletion,
    Completion,
    ModelList,
    Health,
]
_ERRORS = {
    "400": "malformed or invalid request",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "body over the size limit",
    "499": "the client closed the request",
    "500": "internal error (never expected)",
    "503": "queue full, engine stopped, or shutting down",
}
# In OpenAPI 3.1 the schema of an event stream describes one event; `data` holds a JSON chunk
# (or the final `[DONE]`).
_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
_SSE = {"text/event-stream": {"schema": _EVENT}}


def _json(ref: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": ref}}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document of `app`, with radixserve's request and response schemas."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    wanted: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
        (ChatCompletionRequest, "validation"),
        (CompletionRequest, "validation"),
    ]
    wanted += [(m, "serialization") for m in _MODELS]
    keys, defs = models_json_schema(wanted, ref_template=REF)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))

    def ref(model: type[BaseModel], mode: str = "serialization") -> dict[str, Any]:
        return keys[(model, mode)]  # type: ignore[index]

    errors = {
        status: {"description": why, "content": _json(ref(ErrorResponse))}
        for status, why in _ERRORS.items()
    }
    bodies: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
        "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion),
        "/v1/completions": (CompletionRequest, Completion),
    }
    for path, (request, response) in bodies.items():
        op = doc["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": _json(ref(request, "validation"))}
        ok = {**_json(ref(response)), **_SSE}
        op["responses"] = {
            "200": {"description": "the completion (SSE when stream)", "content": ok}
        }
        op["responses"].update(errors)
    gets: dict[str, type[BaseModel]] = {"/v1/models": ModelList, "/health": Health}
    for path, model in gets.items():
        op = doc["paths"][path]["get"]
        op["responses"] = {"200": {"description": "ok", "content": _json(ref(model))}}
        op["responses"].update({s: errors[s] for s in ("401", "500", "503")})
    for path in ("/v1/cache/stats", "/v1/cache/events", "/metrics"):
        op = doc["paths"][path]["get"]
        op["responses"].update({s: errors[s] for s in ("401", "500", "503")})
    doc["paths"]["/v1/cache/events"]["get"]["responses"]["200"]["content"] = _SSE
    doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
        "text/plain": {"schema": {"type": "string"}}
    }
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve `build_openapi(app)` (built once, on first request) at app.openapi_url."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
