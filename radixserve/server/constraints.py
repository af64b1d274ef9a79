"""What a request's output must match: its response_format, vLLM's structured_outputs /
guided_* fields, or (chat) a tool_choice that forces a call; at most one of them."""

from __future__ import annotations

from typing import Any

from radixserve.engine.structured import StructuredOutput
from radixserve.engine.tool_calls import call_grammar
from radixserve.server.errors import APIError
from radixserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
)


def tool_mode(req: ChatCompletionRequest) -> str:
    """How a chat request's tools are used: "none" (no tools, or tool_choice none: the
    output is content), "auto" (calls are parsed out of free text), "required" or
    "named" (the output is constrained to valid calls)."""
    if not req.tools or req.tool_choice == "none":
        return "none"
    if req.tool_choice is None or req.tool_choice == "auto":
        return "auto"
    return "named" if isinstance(req.tool_choice, NamedToolChoice) else "required"


def callable_tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools a constrained call may use: the named one, or all of them."""
    tools = req.tool_dicts() or []
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.name
        return [t for t in tools if t["function"]["name"] == name]
    return tools


def structured_output(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """The one constraint `req` asks for, or None; a 400 naming the second field when it
    asks for two."""
    found: list[StructuredOutput] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutput("json_object", param="response_format"))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        found.append(StructuredOutput.json_schema(schema, "response_format"))
    so = req.structured_outputs
    if so is not None:
        fields = [
            (so.json_, "json"),
            (so.regex, "regex"),
            (so.choice, "choice"),
            (so.grammar, "grammar"),
        ]
        for value, kind in fields:
            if value is not None:
                found.append(_spec(kind, value, "structured_outputs"))
        if so.json_object:
            found.append(StructuredOutput("json_object", param="structured_outputs"))
    guided = [
        (req.guided_json, "json", "guided_json"),
        (req.guided_regex, "regex", "guided_regex"),
        (req.guided_choice, "choice", "guided_choice"),
        (req.guided_grammar, "grammar", "guided_grammar"),
    ]
    for value, kind, param in guided:
        if value is not None:
            found.append(_spec(kind, value, param))
    if isinstance(req, ChatCompletionRequest) and tool_mode(req) in ("required", "named"):
        parallel = tool_mode(req) == "required" and req.parallel_tool_calls is not False
        grammar = call_grammar(callable_tools(req), parallel)
        found.append(StructuredOutput("grammar", grammar, "tool_choice", json_body=True))
    if len(found) > 1:
        raise APIError(
            400,
            f"{found[1].param} cannot be combined with {found[0].param}: "
            "a request takes one output constraint",
            param=found[1].param,
        )
    return found[0] if found else None


def _spec(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput.json_schema(value, param)
    if kind == "choice":
        if not all(isinstance(v, str) and v for v in value):
            raise APIError(400, f"{param}: choices must be non-empty strings", param=param)
        return StructuredOutput.choice(value, param)
    return StructuredOutput(kind, value, param)
