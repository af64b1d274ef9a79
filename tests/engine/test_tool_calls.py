"""Tool calls in the Hermes format: writing tools and calls into prompts, parsing them out."""

from __future__ import annotations

import json

import pytest

from radixserve.engine.structured import StructuredOutput
from radixserve.engine.tool_calls import (
    ToolCallStream,
    call_grammar,
    parse_calls,
    template_messages,
    write_call,
)

NAMES = ["get_weather", "search"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ARGS = '{"city": "Paris"}'
FN = {"name": "f", "arguments": '{"a": 1}'}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_call_block_becomes_a_call_and_the_text_around_it_content() -> None:
    content, calls = parse_calls(f"Let me look.\n{CALL}", NAMES)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_")


def test_an_output_that_is_only_a_json_call_is_a_call() -> None:
    content, calls = parse_calls('[{"name": "search", "parameters": {"q": "cats"}}]', NAMES)
    assert content is None and [c.name for c in calls] == ["search"]


@pytest.mark.parametrize(
    "text",
    [
        "plain prose",
        '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "search", "arguments": {"q": "x"}',  # never closed
        '{"name": "get_weather"',
    ],
)
def test_text_that_does_not_parse_as_a_call_stays_content(text: str) -> None:
    assert parse_calls(text, NAMES) == (text, [])


def test_the_stream_parser_gives_the_same_calls_whatever_the_delta_sizes() -> None:
    text = f"Sure. {CALL}\n{CALL.replace('Paris', 'Oslo')}"
    for size in (1, 2, 7, len(text)):
        stream = ToolCallStream(NAMES)
        events = []
        for i in range(0, len(text), size):
            events += stream.feed(text[i : i + size])
        events += stream.finish()
        content = "".join(e.content for e in events)
        calls = [json.loads(e.call.arguments)["city"] for e in events if e.call]
        assert (content, calls) == ("Sure. ", ["Paris", "Oslo"])


def streamed(stream: ToolCallStream, text: str, size: int) -> list:
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i : i + size])
    return events + stream.finish()


def test_an_incremental_stream_sends_each_call_name_first_then_its_arguments_as_decoded() -> None:
    args = '{"city": "Pa\\"ris}", "days": [1, {"x": 2}]}'  # brackets inside a string
    second = CALL.replace('{"city": "Paris"}', args)
    text = f"{CALL}{second}"
    for size in (1, 3, len(text)):
        events = streamed(ToolCallStream(NAMES, incremental=True), text, size)
        assert [e.start.name for e in events if e.start] == ["get_weather", "get_weather"]
        assert not any(e.call or e.content for e in events)
        cut = [i for i, e in enumerate(events) if e.start][1]
        pieces = ["".join(e.arguments for e in part) for part in (events[:cut], events[cut:])]
        assert pieces == [ARGS, args]
    one_token = ToolCallStream(NAMES, incremental=True)
    first = one_token.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert first[0].start.name == "get_weather" and first[1].arguments == '{"ci'


def test_an_incremental_stream_cut_off_in_a_call_ends_that_call() -> None:
    stream = ToolCallStream(NAMES, incremental=True)
    events = streamed(stream, CALL[: CALL.index("Paris") + 3], 4)
    assert stream.num_calls == 1 and not any(e.content for e in events)
    assert "".join(e.arguments for e in events) == '{"city": "Par'


def test_an_incremental_stream_waits_for_a_block_of_another_shape() -> None:
    text = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    events = streamed(ToolCallStream(NAMES, incremental=True), text, 2)
    assert [json.loads(e.call.arguments) for e in events] == [{"city": "Oslo"}]


def test_the_stream_parser_releases_held_text_that_is_no_call() -> None:
    stream = ToolCallStream(NAMES)
    held = stream.feed("<tool_ca")
    assert held == []  # could still become a tag
    out = held + stream.feed("t is a word") + stream.finish()
    assert "".join(e.content for e in out) == "<tool_cat is a word"


def test_calls_and_results_are_written_as_text_for_a_template_without_tools() -> None:
    msgs = template_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
        ],
        [WEATHER],
        native=False,
    )
    assert msgs[0]["content"].startswith("Be brief.\n\n") and '"get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == CALL == write_call("get_weather", {"city": "Paris"})
    assert msgs[3] == {"role": "tool", "content": "<tool_response>\n18 C\n</tool_response>"}


def test_a_native_template_gets_tool_calls_with_dict_arguments() -> None:
    msgs = template_messages(
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            }
        ],
        [WEATHER],
        native=True,
    )
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert msgs[0]["content"] == ""


def test_the_call_grammar_accepts_valid_calls_only(make_tiny_engine) -> None:
    engine = make_tiny_engine()
    grammar = StructuredOutput("grammar", call_grammar([WEATHER], parallel=True), "tool_choice")
    matcher = engine.grammars.compile(grammar).matcher()
    tok = engine.tokenizer
    two = tok.encode(f"{CALL}{CALL}")
    assert matcher.count_valid(two) == len(two)
    wrong = tok.encode(CALL.replace('"city"', '"town"'))
    assert matcher.count_valid(wrong) < len(wrong)
    single = engine.grammars.compile(
        StructuredOutput("grammar", call_grammar([WEATHER], parallel=False))
    ).matcher()
    assert single.count_valid(two) < len(two)
