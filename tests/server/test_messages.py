"""Chat messages are checked per role as OpenAI's API checks them (the table in docs/server.md)."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.server.errors import APIError
from radixserve.server.protocol import ChatCompletionRequest, parse_body

TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def error_of(*messages: Any) -> APIError:
    with pytest.raises(APIError) as e:
        parse_body(ChatCompletionRequest, {"messages": list(messages)})
    assert e.value.status == 400 and e.value.param == "messages"
    return e.value


def rendered(*messages: Any) -> list[dict[str, Any]]:
    req = parse_body(ChatCompletionRequest, {"messages": list(messages)})
    return req.message_dicts()


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool", "assistant"])
def test_missing_content_is_rejected_for_every_role_without_tool_calls(role: str) -> None:
    extra = {"tool_call_id": "call_1"} if role == "tool" else {}
    err = error_of({"role": role, **extra})
    assert "'content' is required" in err.message and role in err.message


@pytest.mark.parametrize("role", ["system", "user", "tool"])
def test_null_content_is_rejected(role: str) -> None:
    extra = {"tool_call_id": "call_1"} if role == "tool" else {}
    assert "'content' is required" in error_of({"role": role, "content": None, **extra}).message


def test_null_content_is_accepted_for_an_assistant_message_with_tool_calls() -> None:
    msgs = rendered(
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    )
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]}
    assert msgs[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "part,kind",
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "image"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
        ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
    ],
)
def test_media_content_parts_get_a_clear_400(part: dict[str, Any], kind: str) -> None:
    err = error_of({"role": "user", "content": [{"type": "text", "text": "see"}, part]})
    assert f"{kind} content parts" in err.message and "text only" in err.message
    assert "content[1]" in err.message


def test_text_parts_are_joined_in_order() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert rendered({"role": "user", "content": parts}) == [
        {"role": "user", "content": "Hello, world"}
    ]


@pytest.mark.parametrize(
    "message,words",
    [
        ({"role": "user", "content": [{"type": "text"}]}, "needs a string 'text'"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "content[0].text"),
        ({"role": "user", "content": ["hi"]}, "must be an object"),
        ({"role": "user", "content": [{"type": "video"}]}, "unknown content part type"),
        ({"role": "user", "content": 42}, "string or a list of content parts"),
        ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}, "cannot hold"),
        ({"role": "user", "content": "hi", "name": 7}, "messages.0.name"),
        ({"role": "tool", "content": "3"}, "needs 'tool_call_id'"),
        ({"role": "tool", "content": "3", "tool_call_id": 1}, "messages.0.tool_call_id"),
        ({"role": "user", "content": "hi", "tool_call_id": "c"}, "belongs in tool messages"),
        ({"role": "user", "content": "hi", "tool_calls": [TOOL_CALL]}, "belongs in assistant"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, "tool_calls"),
        ({"role": "wizard", "content": "hi"}, "messages.0.role"),
    ],
)
def test_malformed_message_names_what_is_wrong(message: dict[str, Any], words: str) -> None:
    assert words in error_of(message).message


def test_assistant_refusal_part_and_name_are_accepted() -> None:
    msgs = rendered(
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
    )
    assert msgs == [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "I can't."},
    ]
