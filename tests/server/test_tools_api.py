"""Tools, structured outputs, log-probs and n against a real server on the default model,
driven by the official openai client (sync and streaming)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What's the weather in Paris?",
    "Is it raining in Tokyo right now?",
    "Find recent news about electric cars.",
    "What is 17 plus 25?",
    "Look up the population of Canada.",
    "How cold is it in Oslo, in fahrenheit?",
    "Search for a good pasta recipe.",
    "Add 3.5 and 4.25 for me.",
    "Weather in Buenos Aires please.",
    "Who won the last football world cup?",
    "I need the temperature in Cairo.",
    "What's 1000 + 2000?",
    "Find papers about radix trees.",
    "Should I take an umbrella in London today?",
    "Search: best hiking trails in Colorado",
    "Sum 12 and 30.",
    "How hot is it in Dubai?",
    "Find the opening hours of the Louvre.",
    "What is the weather like in Sydney, Australia?",
    "Calculate 8 + 9.",
]


@pytest.fixture(scope="module")
def client(default_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def ask(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def valid_calls(calls: list[Any], names: set[str]) -> bool:
    """Every call names one of `names` and its arguments validate against its schema."""
    for call in calls:
        if call.function.name not in names:
            return False
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return bool(calls)


def streamed_calls(stream: Any) -> tuple[list[Any], str | None]:
    """Tool calls put together from streamed deltas as a client does, and the finish."""
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in stream:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                if d.function.name:
                    entry["name"] = d.function.name
                entry["arguments"] += d.function.arguments or ""
    as_objects = [
        openai.types.chat.ChatCompletionMessageFunctionToolCall(
            id=f"c{i}", type="function", function=c
        )
        for i, c in sorted(calls.items())
    ]
    return as_objects, reason


def call_with(client: openai.OpenAI, model: str, i: int, prompt: str, choice: Any) -> tuple:
    """(calls, finish_reason) of one tool request: streamed for odd i, else whole."""
    kw = dict(model=model, messages=ask(prompt), tools=TOOLS, tool_choice=choice)
    if i % 2:
        return streamed_calls(
            client.chat.completions.create(**kw, max_tokens=120, temperature=0, stream=True)
        )
    r = client.chat.completions.create(**kw, max_tokens=120, temperature=0)
    return r.choices[0].message.tool_calls or [], r.choices[0].finish_reason


def each_prompt(fn: Any) -> list[Any]:
    """fn(i, prompt) for every prompt, sent 10 at a time (the server batches them)."""
    with ThreadPoolExecutor(10) as pool:
        return list(pool.map(fn, range(len(PROMPTS)), PROMPTS))


def test_required_tool_choice_returns_valid_calls_for_20_of_20_prompts(client, model) -> None:
    results = each_prompt(lambda i, p: call_with(client, model, i, p, "required"))
    for prompt, (calls, reason) in zip(PROMPTS, results, strict=True):
        assert reason == "tool_calls", prompt
        assert valid_calls(calls, set(SCHEMAS)), prompt


def test_a_named_tool_returns_a_valid_call_of_it_for_20_of_20_prompts(client, model) -> None:
    def named(i: int, prompt: str) -> tuple:
        choice = {"type": "function", "function": {"name": TOOLS[i % 3]["function"]["name"]}}
        return call_with(client, model, i, prompt, choice)

    for i, (calls, reason) in enumerate(each_prompt(named)):
        assert reason == "tool_calls" and len(calls) == 1, PROMPTS[i]
        assert valid_calls(calls, {TOOLS[i % 3]["function"]["name"]}), PROMPTS[i]


class Place(BaseModel):
    name: str
    country: str
    population: int
    coastal: bool


def test_parse_with_a_pydantic_model_returns_a_parsed_object_for_20_of_20(client, model) -> None:
    def parse(i: int, prompt: str) -> Any:
        return client.beta.chat.completions.parse(
            model=model,
            messages=ask(f"Describe a place related to this as JSON: {prompt}"),
            response_format=Place,
            max_tokens=120,
            temperature=0,
        )

    for r in each_prompt(parse):
        assert isinstance(r.choices[0].message.parsed, Place), r.choices[0].message.content


def test_a_tool_round_trip_ends_in_an_answer_that_reuses_the_cached_prefix(client, model) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are a helpful assistant with tools."},
        *ask("What's the weather in Paris?"),
    ]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120,
        temperature=0,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'})
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=40,
        temperature=0,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert not choice.message.tool_calls
    cached = answer.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16  # the whole first prompt, but its tail


def test_chat_logprobs_match_a_log_softmax_of_the_model_logits(client, model) -> None:
    from radixserve.engine.llm import LLM
    from radixserve.engine.params import SamplingParams

    msgs = ask("Name three colours.")
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    # The same model in this process, in float32 as the server runs it.
    with LLM(dtype="float32", max_model_len=1024, kv_cache_memory="64MiB") as llm:
        ids = llm.tokenizer.apply_chat_template(msgs)
        params = SamplingParams(max_tokens=8, temperature=0, return_logits=True)
        out = llm.generate([ids], params)[0]
    assert len(content) == len(out.logits) - (out.finish_reason == "stop")
    for entry, row, tok in zip(content, out.logits, out.token_ids, strict=False):
        ref = torch.log_softmax(row.float(), dim=-1)
        assert abs(entry.logprob - ref[tok].item()) <= 1e-4
        top = torch.topk(ref, 3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            top.values.tolist(), abs=1e-4
        )


def test_n_4_returns_4_choices_and_seeded_choices_repeat(client, model) -> None:
    kw = dict(model=model, messages=ask("Write a word."), max_tokens=6, temperature=1.0, seed=7)
    first = client.chat.completions.create(n=4, **kw)
    assert sorted(c.index for c in first.choices) == [0, 1, 2, 3]
    again = client.chat.completions.create(n=4, **kw)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    streamed = client.chat.completions.create(n=4, stream=True, **kw)
    texts = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in first.choices]


def test_completions_echo_returns_prompt_logprobs_like_lm_eval_reads_them(client, model) -> None:
    r = client.completions.create(
        model=model, prompt="The capital of France is", echo=True, logprobs=1, max_tokens=1,
        temperature=0,
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith("The capital of France is")
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(client, model) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        bad = {"name": "x", "schema": {"type": "nonsense"}}
        client.chat.completions.create(
            model=model, messages=ask("hi"), max_tokens=4,
            response_format={"type": "json_schema", "json_schema": bad},
        )  # fmt: skip
    assert e.value.body["param"] == "response_format" and "nonsense" in e.value.body["message"]
