"""How a chat response streams tool calls (ChatResponder on a scripted engine output)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from radixserve.engine.outputs import RequestMetrics, RequestOutput
from radixserve.server.chat import ChatResponder

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedStream:
    """An OutputStream of one choice that yields the text in pieces of `size` characters,
    then stops."""

    num_choices = 1

    def __init__(self, text: str, size: int) -> None:
        self.pieces = [text[i : i + size] for i in range(0, len(text), size)]
        self.final: RequestOutput | None = None
        self.finished = False

    @property
    def finals(self) -> list[RequestOutput]:
        return [self.final] if self.final is not None else []

    async def __aiter__(self) -> Any:
        text = ""
        for k, piece in enumerate(self.pieces):
            text += piece
            last = k == len(self.pieces) - 1
            out = RequestOutput(
                "r", [1], list(range(k + 1)), text, [k], piece, last, "stop" if last else None,
                0, RequestMetrics(0.0),
            )  # fmt: skip
            self.final, self.finished = out, last
            yield out

    def close(self) -> None:
        pass


def stream_chunks(constrained: bool, size: int) -> list[dict[str, Any]]:
    responder = ChatResponder(None, {"id": "x"}, ["get_weather"], None, constrained)  # type: ignore[arg-type]

    async def go() -> list[bytes]:
        return [b async for b in responder.events(ScriptedStream(CALL, size), False)]

    body = b"".join(asyncio.run(go())).decode()
    return [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]


def call_deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]


def test_a_constrained_call_streams_its_name_first_then_its_arguments_in_pieces() -> None:
    chunks = stream_chunks(constrained=True, size=4)
    deltas = call_deltas(chunks)
    head = deltas[0]
    assert head["function"] == {"name": "get_weather", "arguments": ""} and head["id"]
    pieces = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(pieces) > 3 and "".join(pieces) == '{"city": "Paris"}'
    assert all(d["index"] == 0 for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)


def test_an_auto_call_streams_whole_once_its_block_parses() -> None:
    deltas = call_deltas(stream_chunks(constrained=False, size=4))
    assert [d["function"] for d in deltas] == [
        {"name": "get_weather", "arguments": ""},
        {"arguments": '{"city": "Paris"}'},
    ]
