"""Tool calls in the Hermes / Qwen format: how tools and calls are written into a prompt, the
grammar that makes an output one or more valid calls, and parsing calls out of text.

A call is written (and expected back) as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Templates that take `tools` themselves (Qwen 2.5/3, Hermes 2/3 and others) get the tools and
the messages' `tool_calls` as Hugging Face defines them; for a template without tool support
(the default model's plain ChatML) the tools are described in the system message and calls
and results are written in the same format as plain text. Parsing accepts that format and
also an output that is nothing but a JSON call object or a list of them (`{"name": ...,
"arguments" | "parameters": {...}}`, as Llama 3.x writes calls).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.engine.structured import JSON_STYLE, bound_integers

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    """One tool call found in an output: the function's name and its JSON arguments (text)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The `function` object of an OpenAI tool (`{"type": "function", "function": {...}}`)."""
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) else {}


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's arguments schema (an object with no required keys when it has none)."""
    params = function_of(tool).get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def tools_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system-message text that describes `tools` to a model whose template cannot."""
    lines = [json.dumps(function_of(t), ensure_ascii=False) for t in tools]
    return (
        "You can call functions to help answer. The functions available, one JSON signature "
        "per line:\n<tools>\n" + "\n".join(lines) + "\n</tools>\n\n"
        "To call a function, reply with a JSON object holding its name and arguments "
        f"between {OPEN} and {CLOSE} tags, one call per block:\n"
        f'{OPEN}\n{{"name": "function_name", "arguments": {{"arg": "value"}}}}\n{CLOSE}'
    )


def write_call(name: str, arguments: Any) -> str:
    """One call as the model writes it (arguments: a dict, or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: written as the string it is
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def template_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, native: bool
) -> list[dict[str, Any]]:
    """`messages` ready for a chat template. `native` templates take `tools` and
    `tool_calls` (arguments as dicts, as Hugging Face's templates expect); for the others,
    calls become text in the assistant's content, tool results are wrapped in
    <tool_response> tags, and `tools` are described in the system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg = {"role": m["role"], "content": m.get("content") or ""}
        calls = m.get("tool_calls") or []
        if native:
            if calls:
                msg["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c.get("id"),
                        "function": {
                            "name": c["function"]["name"],
                            "arguments": _as_dict(c["function"]["arguments"]),
                        },
                    }
                    for c in calls
                ]
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    msg[key] = m[key]
        else:
            if calls:
                written = [write_call(c["function"]["name"], c["function"].get("arguments", {}))
                           for c in calls]  # fmt: skip
                msg["content"] = "\n".join(([msg["content"]] if msg["content"] else []) + written)
            if m["role"] == "tool":
                msg["content"] = f"<tool_response>\n{msg['content']}\n</tool_response>"
        out.append(msg)
    if tools and not native:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def call_grammar(tools: Sequence[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance) whose sentences are one call to one of `tools` (or
    several, one block per line, when `parallel`), with arguments valid against the tool's
    parameters schema."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function_of(t).get("name", "")},
                "arguments": bound_integers(parameters_of(t)),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    body = {"anyOf": variants, "x-guidance": JSON_STYLE}
    # Blocks follow each other without a newline: after a call the model chooses between
    # ending (its EOS) and another `<tool_call>`, not a newline that it takes by habit
    # (SmolLM2 did, then wrote a second, duplicate call).
    repeat = " call*" if parallel else ""
    return (
        f"start: call{repeat}\n"
        f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
        f"body: %json {json.dumps(body, ensure_ascii=False)}\n"
    )


def parse_calls(text: str, names: Sequence[str]) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of an output. Calls are the <tool_call> blocks that hold a JSON
    object naming one of `names`, or the whole output as a JSON call (or list of calls);
    content is the text around them (None when nothing is left). Text that does not parse
    as a call stays content: never an error."""
    calls: list[ParsedCall] = []
    rest: list[str] = []
    pos = 0
    for m in _CALL_BLOCK.finditer(text):
        call = _call_from_json(m.group(1), names)
        if call is None:
            continue
        rest.append(text[pos : m.start()])
        calls.append(call)
        pos = m.end()
    if not calls:
        whole = _bare_calls(text, names)
        if whole:
            return None, whole
        return text, []
    rest.append(text[pos:])
    content = "".join(rest).strip()
    return content or None, calls


def _bare_calls(text: str, names: Sequence[str]) -> list[ParsedCall]:
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return []
    try:
        value = json.loads(stripped)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_call_from_value(v, names) for v in items]
    return [c for c in calls if c is not None] if all(calls) and items else []


def _call_from_json(text: str, names: Sequence[str]) -> ParsedCall | None:
    try:
        value, end = _DECODER.raw_decode(text)
    except ValueError:
        return None
    if text[end:].strip():
        return None
    return _call_from_value(value, names)


def _call_from_value(value: Any, names: Sequence[str]) -> ParsedCall | None:
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    args = value.get("arguments", value.get("parameters", {}))
    if not isinstance(name, str) or name not in names or not isinstance(args, (dict, str)):
        return None
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            parsed = json.loads(args)
        except ValueError:
            return None
        if not isinstance(parsed, dict):
            return None
        return ParsedCall(name, args)
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


@dataclass
class StreamEvent:
    """What a streamed delta turns into: content text, one complete call, or (incremental
    streams) the start of a call (`start`: its id and name, no arguments) or a piece of the
    arguments of the call started last."""

    content: str = ""
    call: ParsedCall | None = None
    start: ParsedCall | None = None
    arguments: str = ""


# How a constrained call block opens (call_grammar writes exactly this, json.dumps style).
_HEAD = re.compile(r'\s*\{"name": "([A-Za-z0-9_.-]{1,64})", "arguments": ')


class ToolCallStream:
    """Splits a streamed output into content deltas and complete calls, as it grows.

    Content is passed through as it comes, except text that may be the start of a call
    (a partial `<tool_call>` tag, an open block, or an output that starts with a JSON
    object), which is held until it is known: a block that parses becomes one call, and
    anything that does not parse is released as content when the output ends.

    `incremental` (for outputs constrained by `call_grammar`, which fixes the block's shape):
    a call is streamed as OpenAI streams one, its id and name as soon as the name is
    complete, then its arguments as they are decoded."""

    def __init__(self, names: Sequence[str], incremental: bool = False) -> None:
        self.names = list(names)
        self.incremental = incremental
        self.text = ""
        self._pos = 0  # everything before it has been handed out
        self.num_calls = 0
        self._after_call = False  # whitespace right after a call block is not content
        self._args: _ArgumentScan | None = None  # the open block's arguments, once started

    def feed(self, delta: str) -> list[StreamEvent]:
        """The events `delta` completes."""
        self.text += delta
        events: list[StreamEvent] = []
        while True:
            if self._after_call:
                while self._pos < len(self.text) and self.text[self._pos] in " \n":
                    self._pos += 1
                if self._pos == len(self.text):
                    return events
                self._after_call = False
            if self._bare_pending():
                return events  # the whole output may be a JSON call: wait for the end
            start = self.text.find(OPEN, self._pos)
            if start == -1:
                safe = len(self.text) - _partial_tag(self.text, self._pos)
                self._emit_content(events, safe)
                return events
            self._emit_content(events, start)
            end = self.text.find(CLOSE, start)
            if self.incremental:
                self._stream_arguments(events, start + len(OPEN), end)
            if end == -1:
                return events  # an open block: wait for its end
            end += len(CLOSE)
            if self._args is not None:  # streamed already: the block is done
                self._args = None
                self.num_calls += 1
                self._pos = end
                self._after_call = True
                continue
            block = self.text[start + len(OPEN) : end - len(CLOSE)]
            call = _call_from_json(block.strip(), self.names)
            if call is None:
                self._emit_content(events, end)
            else:
                events.append(StreamEvent(call=call))
                self.num_calls += 1
                self._pos = end
                self._after_call = True

    def finish(self) -> list[StreamEvent]:
        """Events for whatever was held back when the output ended."""
        events: list[StreamEvent] = []
        if self._args is not None:  # cut off inside a streamed call (max_tokens): it ends here
            self._args, self._pos = None, len(self.text)
            self.num_calls += 1
            return events
        tail = self.text[self._pos :]
        if self._pos == 0 and not self.num_calls:
            calls = _bare_calls(tail, self.names)
            if calls:
                self._pos = len(self.text)
                self.num_calls += len(calls)
                return [StreamEvent(call=c) for c in calls]
        if tail.strip() or (tail and not self.num_calls):
            events.append(StreamEvent(content=tail))
        self._pos = len(self.text)
        return events

    def _stream_arguments(self, events: list[StreamEvent], body: int, end: int) -> None:
        """Incremental mode, in the block whose body starts at `body` (its close at `end`, or
        -1 while open): the call's start once its name is known, then new argument text."""
        if self._args is None:
            m = _HEAD.match(self.text, body)
            if m is None or m.group(1) not in self.names:
                return  # not (yet) the shape the grammar writes: wait for the whole block
            self._args = _ArgumentScan(m.end())
            events.append(StreamEvent(start=ParsedCall(m.group(1), "")))
        piece = self._args.advance(self.text, len(self.text) if end == -1 else end)
        if piece:
            events.append(StreamEvent(arguments=piece))

    def _bare_pending(self) -> bool:
        return self._pos == 0 and not self.num_calls and self.text.lstrip().startswith(("{", "["))

    def _emit_content(self, events: list[StreamEvent], upto: int) -> None:
        if upto > self._pos:
            events.append(StreamEvent(content=self.text[self._pos : upto]))
            self._pos = upto


class _ArgumentScan:
    """Where a streamed call's arguments (one JSON value) start, how far they were handed
    out, and whether they are complete: a string, bracket and escape scan of the text."""

    def __init__(self, at: int) -> None:
        self.pos = at
        self.depth = 0
        self.in_string = self.escaped = self.done = False

    def advance(self, text: str, upto: int) -> str:
        """The argument text in text[pos:upto] not handed out yet (stops after the value)."""
        start = self.pos
        while self.pos < upto and not self.done:
            ch = text[self.pos]
            self.pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
        return text[start : self.pos]


def _partial_tag(text: str, start: int) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text) - start), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _as_dict(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
