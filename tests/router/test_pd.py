"""Prefill/decode disaggregation end to end: `serve --disaggregation-mode prefill|decode` and
`route --pd-disaggregation` against a single server, real processes on the default model in
float32, driven with `openai`. Multi-turn chats give a single server's greedy text; the prefill
worker draws each request's first token only; later turns report cached tokens; a prefill
worker that is gone is a clear 503."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support import ServerProcess, wait_for

pytestmark = pytest.mark.slow

ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--log-level", "warning")


def metric(url: str, name: str) -> float:
    """A counter's value (summed over labels) from `url`'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$"
    return sum(float(v) for v in re.findall(pattern, text, flags=re.M))


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Any]]:
    """A single server, and `serve --pd 1:1` (a prefill worker, a decode worker and the PD
    router over them, as one command)."""
    single = ServerProcess(*ARGS)
    pd = ServerProcess("--pd", "1:1", *ARGS)
    try:
        single.wait_ready()
        pd.wait_ready()
        health = httpx.get(f"{pd.url}/health", timeout=10).json()
        (decode,), (prefill,) = health["workers"], health["prefill_workers"]
        yield {"single": single.url, "router": pd.url, "prefill": prefill["url"],
               "decode": decode["url"]}  # fmt: skip
    finally:
        single.close()
        pd.close()


def shm_files() -> set[Path]:
    """The shm handoff files there are now."""
    shm = Path("/dev/shm")
    return set(shm.glob("radixserve-pd-*")) if shm.is_dir() else set()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(url: str, messages: list[dict[str, str]], stream: bool = False) -> tuple[str, Any]:
    kw: dict[str, Any] = dict(model=None, messages=messages, max_tokens=24, temperature=0)
    if stream:
        chunks = list(
            client(url).chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].usage
    r = client(url).chat.completions.create(**kw)
    return r.choices[0].message.content or "", r.usage


def test_multi_turn_chats_through_the_pd_router_give_a_single_servers_text(fleet) -> None:
    topics = ["volcanoes", "the history of printing"]
    convs = {
        t: [{"role": "system", "content": "You are a concise assistant. " * 8}] for t in topics
    }
    requests = 0
    before = shm_files()
    prefill, decode = fleet["prefill"], fleet["decode"]
    last_prompt = dict.fromkeys(topics, 0)
    for turn in range(3):
        for i, topic in enumerate(topics):
            msgs = convs[topic]
            msgs.append({"role": "user", "content": f"Turn {turn}: tell me about {topic}."})
            want, _ = chat(fleet["single"], msgs)
            got, usage = chat(fleet["router"], msgs, stream=(turn + i) % 2 == 1)
            requests += 1
            assert got == want, (turn, topic)
            # The conversation so far was prefilled on the prefill worker, and its answers
            # came back to it from the decode worker: the hit reaches past the last prompt.
            if turn:
                assert usage.prompt_tokens_details.cached_tokens > last_prompt[topic]
            last_prompt[topic] = usage.prompt_tokens
            msgs.append({"role": "assistant", "content": got})
            wait_for(  # in the background, after the answer: before the next turn here
                lambda n=requests: metric(decode, "radixserve_kv_write_back_requests_total") == n,
                timeout=30, what="the decode worker's write-back",
            )  # fmt: skip
    assert metric(decode, "radixserve_kv_write_back_tokens_total") > 0
    # The prefill worker drew one token per request; the decode worker emitted every token.
    assert metric(prefill, "radixserve_generation_tokens_total") == requests
    assert metric(decode, "radixserve_kv_transfer_requests_total") == requests
    assert metric(decode, "radixserve_kv_transfer_bytes_total") > 0
    # On one host the K/V went through /dev/shm (--disaggregation-transfer-backend auto); the
    # decode worker removed each file it read.
    assert shm_files() <= before


def test_a_decode_worker_whose_prefill_worker_is_gone_answers_503(fleet) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hello there."}],
        "max_tokens": 4,
        "kv_transfer_params": {"prefill_url": "http://127.0.0.1:9"},  # nothing listens
    }
    r = httpx.post(f"{fleet['decode']}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "prefill_unavailable" and "127.0.0.1:9" in err["message"]
    # and it keeps serving
    body["kv_transfer_params"] = {"prefill_url": fleet["prefill"]}
    r = httpx.post(f"{fleet['decode']}/v1/chat/completions", json=body, timeout=60)
    assert r.is_success, r.text


def test_the_prefill_route_checks_its_input(fleet) -> None:
    url = f"{fleet['prefill']}/v1/disaggregation/prefill"
    bad = [
        {"token_ids": [], "start": 0},
        {"token_ids": [1, 2, 3], "start": 3},
        {"token_ids": [1, 2, 3], "sampling": {"n": 2}},
        {"token_ids": [1, 2, 3], "sampling": {"nope": 1}},
    ]
    for body in bad:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
    r = httpx.post(url, json={"token_ids": [1, 2, 3, 4, 5], "sampling": {"temperature": 0}})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    assert r.content.startswith(b"RADIXSERVE-PD-1\n")


def test_a_sliding_window_model_through_serve_pd_gives_a_single_servers_text(
    gemma_gguf: Path,
) -> None:
    """Gemma 3 270M (Q4_K_M, local + global attention layers, a window pool on the CPU) in
    float32: three turns of a growing prompt through `serve --pd 1:1` give a single server's
    text, and later turns are cached."""
    args = ("--model", str(gemma_gguf), *ARGS)
    single, pd = ServerProcess(*args), ServerProcess("--pd", "1:1", *args)
    try:
        single.wait_ready()
        pd.wait_ready()
        text = "You are a helpful assistant. " * 40
        for turn in range(3):
            text += f"\nQuestion {turn}: tell me about the moon and its phases.\nAnswer:"
            body = {"prompt": text, "max_tokens": 24, "temperature": 0}
            want = httpx.post(f"{single.url}/v1/completions", json=body, timeout=300).json()
            got = httpx.post(f"{pd.url}/v1/completions", json=body, timeout=300).json()
            assert got["choices"][0]["text"] == want["choices"][0]["text"], turn
            if turn:
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            text += got["choices"][0]["text"]
    finally:
        single.close()
        pd.close()
