"""Speculative decoding through the HTTP API, with the official client (tiny engine, in
process): the usage object reports drafted tokens as OpenAI's Predicted Outputs do, and
/metrics counts them with vLLM's meanings."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import LLMEngine
from radixserve.server.app import build_app

SPEC = json.dumps({"method": "radix", "num_speculative_tokens": 6})


@pytest.fixture(scope="module")
def app(tiny_pair_factory: Callable[..., Any], default_tokenizer: Any) -> Iterator[TestClient]:
    _, model = tiny_pair_factory(
        vocab_size=49152, hidden_size=32, intermediate_size=64, max_position_embeddings=512
    )
    cfg = EngineConfig(
        block_size=4, num_blocks=256, max_num_batched_tokens=256, speculative_config=SPEC
    )
    engine = LLMEngine.from_parts(cfg, model, default_tokenizer, "tiny")
    engine.start()
    try:
        with TestClient(build_app(engine)) as client:
            yield client
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(app: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="none", http_client=app)


def _metric(app: TestClient, name: str) -> float:
    text = app.get("/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def test_a_regenerated_completion_reports_accepted_predictions(
    client: openai.OpenAI, app: TestClient
) -> None:
    prompt = [101, 2046, 318, 257, 1332, 11, 290, 994, 318, 1194, 13]
    kw: dict[str, Any] = dict(model="tiny", prompt=prompt, max_tokens=30, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    first = client.completions.create(**kw)
    drafts_before = _metric(app, "radixserve_spec_decode_num_draft_tokens_total")
    accepted_before = _metric(app, "radixserve_spec_decode_num_accepted_tokens_total")
    second = client.completions.create(**kw)
    assert second.choices[0].text == first.choices[0].text
    details = second.usage.completion_tokens_details
    assert details is not None
    accepted, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
    assert accepted is not None and rejected is not None and accepted >= 20
    drafted = _metric(app, "radixserve_spec_decode_num_draft_tokens_total") - drafts_before
    kept = _metric(app, "radixserve_spec_decode_num_accepted_tokens_total") - accepted_before
    assert (kept, drafted) == (accepted, accepted + rejected)
    assert _metric(app, "radixserve_spec_decode_num_drafts_total") > 0


def test_a_streamed_chat_reports_them_in_its_usage_chunk(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say the alphabet twice."}]
    kw: dict[str, Any] = dict(model="tiny", messages=messages, max_tokens=24, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    client.chat.completions.create(**kw)
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 24
    details = usage[0].completion_tokens_details
    assert details is not None and (details.accepted_prediction_tokens or 0) > 0
