"""The OpenAI API of a real server on the default model, driven by the official client."""

from __future__ import annotations

import json
import re
import threading
import uuid
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_for

pytestmark = pytest.mark.slow

LONG_PREFIX = (
    "You are a meticulous assistant for a library. The library has three floors: fiction on "
    "the first, science on the second and history on the third. Opening hours are nine to "
    "five on weekdays and ten to two on Saturdays. Members may borrow up to six books for "
    "three weeks. Always answer in one short sentence. "
)


@pytest.fixture(scope="module")
def server(default_server: Any) -> Any:
    return default_server


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def metric_values(server: Any) -> dict[str, float]:
    """Every sample of /metrics, keyed by name and sorted labels."""
    text = httpx.get(f"{server.url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_health_is_ok(server: Any) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_the_server_freezes_its_startup_heap_once_it_listens(server: Any) -> None:
    frozen = re.search(r"start-up heap: (\d+) objects frozen out of garbage", server.log())
    assert frozen is not None and int(frozen.group(1)) > 0


def test_version_route_answers_the_package_version(server: Any) -> None:
    from radixserve import __version__

    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_models_lists_the_default_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_chat_completion_returns_text_and_usage(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
        ],
        max_tokens=8,
        temperature=0,
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_accepts_text_token_ids_and_a_list_of_one_prompt(
    client: openai.OpenAI, model: str
) -> None:
    by_text = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    ids = client.completions.create(model=model, prompt=[504, 3575, 282], max_tokens=4)
    one = client.completions.create(
        model=model, prompt=["The capital of France is"], max_tokens=4, temperature=0
    )
    assert by_text.choices[0].text == one.choices[0].text != ""
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens > 0


def test_concurrent_requests_each_get_their_own_answer(client: openai.OpenAI, model: str) -> None:
    prompts = [f"List {n} fruits:" for n in range(2, 8)]
    results: dict[str, openai.types.Completion] = {}

    def ask(prompt: str) -> None:
        results[prompt] = client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0
        )

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == sorted(prompts)
    assert len({r.id for r in results.values()}) == len(prompts)
    for r in results.values():
        assert 0 < r.usage.completion_tokens <= 6 and r.choices[0].text


def test_streamed_chat_equals_non_streamed(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=16,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def test_stop_string_ends_the_completion_before_it(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="Count: one, two, three,", max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full.strip().split()[1] if len(full.split()) > 1 else full[1:3]
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="My favourite animal is", max_tokens=12, temperature=1.0)
    a = client.completions.create(**kwargs, seed=1234).choices[0].text
    b = client.completions.create(**kwargs, seed=1234).choices[0].text
    assert a == b


def test_different_seeds_sample_different_text(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="My favourite animal is", max_tokens=16, temperature=1.0)
    texts = [client.completions.create(**kwargs, seed=s).choices[0].text for s in (1, 2, 3)]
    assert len(set(texts)) == 3, texts


def test_temperature_zero_is_greedy_whatever_the_seed(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, prompt="My favourite animal is", max_tokens=16)
    sampled = client.completions.create(**kwargs, temperature=1.0, seed=1234).choices[0].text
    zero = [
        client.completions.create(**kwargs, temperature=0, seed=s).choices[0].text
        for s in (1234, 5)
    ]
    # top_k=1 asks for the argmax another way (through the sampler's cut, not the temperature).
    top1 = (
        client.completions.create(**kwargs, temperature=1.0, seed=1234, extra_body={"top_k": 1})
        .choices[0]
        .text
    )
    assert zero[0] == zero[1] == top1 != sampled


def test_shared_prefix_reports_cached_tokens_in_whole_blocks(
    client: openai.OpenAI, model: str, block_size: int
) -> None:
    system = LONG_PREFIX + f"(session {uuid.uuid4().hex})"
    first = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hours?"}],
        max_tokens=4,
        temperature=0,
    )
    second = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Floors?"}],
        max_tokens=4,
        temperature=0,
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % block_size == 0
    assert cached <= second.usage.prompt_tokens


def test_different_cache_salts_never_share_a_prefix(client: openai.OpenAI, model: str) -> None:
    prompt = LONG_PREFIX + f"Question {uuid.uuid4().hex}: what is on the second floor?"

    def cached(salt: str) -> int:
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt}
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("bob") == 0
    assert cached("alice") > 0  # the same salt does share


def test_dropped_stream_aborts_and_releases_locked_blocks(server: Any) -> None:
    aborted = metric_values(server).get("radixserve_requests_total{finish_reason=abort}", 0.0)
    body = {"prompt": LONG_PREFIX, "max_tokens": 600, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)

    def aborted_and_unlocked() -> bool:
        metrics = metric_values(server)
        return (
            metrics["radixserve_cache_blocks{state=locked}"] == 0
            and metrics.get("radixserve_requests_total{finish_reason=abort}", 0) > aborted
        )

    wait_for(aborted_and_unlocked, 20, "the abort and its blocks unlocked", every=0.1)
    stats = httpx.get(f"{server.url}/v1/cache/stats").json()
    assert metric_values(server)["radixserve_requests_total{finish_reason=abort}"] == aborted + 1
    assert stats["locked_blocks"] == 0, stats


def test_metrics_parse_and_move_with_traffic(client: openai.OpenAI, model: str, server) -> None:
    before = metric_values(server)
    client.completions.create(model=model, prompt="Hello there", max_tokens=5, temperature=0)
    after = metric_values(server)
    for name in (
        "radixserve_prompt_tokens_total",
        "radixserve_generation_tokens_total",
        "radixserve_prefix_cache_queries_total",
        "radixserve_time_to_first_token_seconds_count",
        "radixserve_e2e_request_latency_seconds_count",
        "radixserve_inter_token_latency_seconds_count",
    ):
        assert after[name] > before.get(name, 0.0), name
    done = "radixserve_requests_total{finish_reason=length}"
    assert after[done] == before.get(done, 0.0) + 1
    ok = "radixserve_http_responses_total{route=/v1/completions,status=200}"
    assert after[ok] == before.get(ok, 0.0) + 1
    for name in ("radixserve_num_requests_waiting", "radixserve_num_requests_running"):
        assert name in after
    blocks = [after[f"radixserve_cache_blocks{{state={s}}}"] for s in ("free", "cached")]
    assert sum(blocks) <= after["radixserve_cache_blocks_total"]


def test_cache_stats_is_json(server: Any) -> None:
    r = httpx.get(f"{server.url}/v1/cache/stats")
    assert r.status_code == 200 and isinstance(r.json(), dict)


def test_cache_events_send_a_snapshot_then_inserts(
    client: openai.OpenAI, model: str, server: Any, block_size: int
) -> None:
    prompt = LONG_PREFIX + f"Events {uuid.uuid4().hex}."
    events: list[dict] = []
    ready, got_insert = threading.Event(), threading.Event()

    def listen() -> None:
        with httpx.stream("GET", f"{server.url}/v1/cache/events", timeout=30) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(json.loads(line[6:]))
                ready.set()
                if events[-1].get("type") in ("insert", None):  # None: an error event
                    got_insert.set()
                    return

    threading.Thread(target=listen, daemon=True).start()
    assert ready.wait(30)
    assert events[0].get("type") == "snapshot", events[0]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert got_insert.wait(30)
    assert isinstance(events[0]["paths"], list)
    insert = events[-1]
    assert insert["namespace"] is None
    assert len(insert["token_ids"]) % block_size == 0
    assert len(insert["token_ids"]) <= r.usage.total_tokens
