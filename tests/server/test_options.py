"""Serve options: --api-key, --no-prefix-cache, --served-model-name, --max-waiting (503)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

KEY = "test-key-123"
MODEL = "smol"  # --served-model-name
PROMPT = (
    "A long shared preamble that would normally be cached by the radix tree, repeated so "
    "that it spans several KV blocks of sixteen tokens each. " * 3
)


@pytest.fixture(scope="module")
def server(launch: Any) -> Iterator[Any]:
    with launch(
        "--api-key",
        KEY,
        "--no-prefix-cache",
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
        "--served-model-name",
        MODEL,
    ) as s:
        yield s


def client(server: Any, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_v1_routes_reject_a_missing_key(server: Any) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
        r = httpx.request(method, f"{server.url}{path}", json={"prompt": "hi"})
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_v1_routes_reject_a_wrong_key(server: Any) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong-key").models.list()
    r = httpx.get(f"{server.url}/v1/cache/stats", headers={"Authorization": f"Basic {KEY}"})
    assert r.status_code == 401


def test_v1_routes_accept_the_right_key(server: Any) -> None:
    c = client(server, KEY)
    assert c.models.list().data[0].id == MODEL
    r = c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens > 0


def test_health_and_metrics_stay_open(server: Any) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_served_model_name_replaces_the_model_name(server: Any) -> None:
    c = client(server, KEY)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert (
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        ).model
        == MODEL
    )
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)


def test_no_prefix_cache_reports_zero_cached_tokens(server: Any) -> None:
    c = client(server, KEY)
    for _ in range(2):
        r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_queue_over_its_limit_answers_503_with_retry_after(server: Any) -> None:
    # One running (--max-num-seqs 1) and one waiting (--max-waiting 1) request fill the
    # engine; a third must be turned away at once.
    body = {"prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # keep a reference: a dropped iterator disconnects
            assert next(lines).startswith("data: ")  # it is decoding
            with http.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200
                r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
