"""Malformed and hostile requests get a 4xx with an OpenAI error body, never a 500 or a trace."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


def comp(**fields: Any) -> dict[str, Any]:
    return {"json": {"prompt": "hi", "max_tokens": 2, **fields}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"json": {"messages": MSGS, "max_tokens": 2, **fields}}


# (id, method, path, httpx keyword arguments, expected status)
CASES = [
    ("malformed_json", "POST", COMP, {"content": b'{"prompt": "hi",'}, 400),
    ("json_array_body", "POST", COMP, {"content": b"[1, 2, 3]"}, 400),
    ("empty_body", "POST", COMP, {"content": b""}, 400),
    ("non_utf8_bytes", "POST", COMP, {"content": b'{"prompt": "\xff\xfe\xfa"}'}, 400),
    ("nan_literal", "POST", COMP, {"content": b'{"prompt": "hi", "temperature": NaN}'}, 400),
    ("deeply_nested_json", "POST", COMP, {"content": b"[" * 100_000 + b"]" * 100_000}, 400),
    ("form_encoded_body", "POST", COMP, {"data": {"prompt": "hi"}}, 400),
    ("missing_prompt", "POST", COMP, {"json": {"max_tokens": 2}}, 400),
    ("missing_messages", "POST", CHAT, {"json": {"max_tokens": 2}}, 400),
    ("empty_messages", "POST", CHAT, chat(messages=[]), 400),
    ("wrong_role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400),
    ("content_not_text", "POST", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400),
    ("message_not_object", "POST", CHAT, chat(messages=["hi"]), 400),
    ("message_without_content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400),
    ("null_content", "POST", CHAT, chat(messages=[{"role": "user", "content": None}]), 400),
    (
        "tool_message_without_call_id",
        "POST",
        CHAT,
        chat(messages=[{"role": "tool", "content": "3"}]),
        400,
    ),
    (
        "image_content_part",
        "POST",
        CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        ),
        400,
    ),
    ("negative_max_tokens", "POST", COMP, comp(max_tokens=-5), 400),
    ("zero_max_tokens", "POST", COMP, comp(max_tokens=0), 400),
    ("max_tokens_as_string", "POST", COMP, comp(max_tokens="10"), 400),
    ("max_tokens_as_float", "POST", COMP, comp(max_tokens=2.5), 400),
    ("max_tokens_as_bool", "POST", COMP, comp(max_tokens=True), 400),
    ("temperature_negative", "POST", COMP, comp(temperature=-1), 400),
    ("temperature_as_string", "POST", CHAT, chat(temperature="hot"), 400),
    ("top_p_zero", "POST", COMP, comp(top_p=0), 400),
    ("top_p_above_one", "POST", COMP, comp(top_p=1.5), 400),
    ("top_k_as_string", "POST", COMP, comp(top_k="5"), 400),
    ("n_above_the_limit", "POST", CHAT, chat(n=17), 400),
    ("unknown_model", "POST", CHAT, chat(model="gpt-4o"), 404),
    ("one_megabyte_prompt", "POST", COMP, comp(prompt="a " * 500_000), 400),
    ("prompt_longer_than_context", "POST", COMP, comp(prompt="hello " * 2000), 400),
    ("prompt_plus_max_tokens_over_context", "POST", COMP, comp(max_tokens=5000), 400),
    ("empty_prompt", "POST", COMP, comp(prompt=""), 400),
    ("empty_token_list", "POST", COMP, comp(prompt=[]), 400),
    ("token_id_outside_vocab", "POST", COMP, comp(prompt=[10**9]), 400),
    ("negative_token_id", "POST", COMP, comp(prompt=[-1]), 400),
    ("two_prompts", "POST", COMP, comp(prompt=["a", "b"]), 400),
    ("huge_stop_list", "POST", COMP, comp(stop=["x"] * 10_000), 400),
    ("stop_not_a_string", "POST", COMP, comp(stop=5), 400),
    ("stream_as_string", "POST", COMP, comp(stream="yes"), 400),
    ("stream_options_as_string", "POST", CHAT, chat(stream=True, stream_options="yes"), 400),
    ("priority_as_string", "POST", COMP, comp(priority="high"), 400),
    ("cache_salt_as_number", "POST", COMP, comp(cache_salt=7), 400),
    ("empty_cache_salt", "POST", COMP, comp(cache_salt=""), 400),
    ("seed_beyond_int64", "POST", COMP, comp(seed=2**70), 400),
    ("presence_penalty_beyond_2", "POST", CHAT, chat(presence_penalty=3.0), 400),
    ("top_logprobs_above_20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400),
    ("top_logprobs_without_logprobs", "POST", CHAT, chat(top_logprobs=2), 400),
    ("suffix_unsupported", "POST", COMP, comp(suffix="x"), 400),
    ("body_over_8_mib", "POST", COMP, {"content": b" " * (9 * 1024 * 1024)}, 413),
    ("unknown_route", "GET", "/v1/nothing-here", {}, 404),
    ("wrong_method", "GET", COMP, {}, 405),
]


@pytest.fixture(scope="module")
def server(default_server: Any) -> Any:
    return default_server


@pytest.fixture(scope="module")
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize(
    "method,path,kwargs,status", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_request_gets_a_4xx_error_body(
    http: httpx.Client, method: str, path: str, kwargs: dict[str, Any], status: int
) -> None:
    r = http.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text and 'File "' not in r.text


def test_server_answers_normally_after_hostile_requests(http: httpx.Client) -> None:
    for _, method, path, kwargs, _ in CASES[:10]:
        http.request(method, path, **kwargs)
    r = http.post(COMP, json={"prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] > 0
    assert http.get("/health").status_code == 200


def test_no_server_error_was_ever_returned(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    assert 'status="5' not in text


def test_openai_client_raises_typed_errors(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=-1)
    assert bad.value.status_code == 400 and "max_tokens" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="word " * 3000, max_tokens=2
        )
    assert long.value.code == "context_length_exceeded"
