"""Request parsing, the error mapping and the serve options, without a model."""

from __future__ import annotations

import argparse
import gc
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from radixserve import launch
from radixserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    PromptTooLongError,
    QueueFullError,
    RequestTooLargeError,
)
from radixserve.server.errors import APIError, to_api_error
from radixserve.server.main import freeze_startup_heap, run_serve, startup_line
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body


@pytest.mark.parametrize(
    "exc,status",
    [
        (InvalidRequestError("bad", "x"), 400),
        (PromptTooLongError("long", "prompt"), 400),
        (RequestTooLargeError("huge", "max_tokens"), 400),
        (ModelNotFoundError("who"), 404),
        (QueueFullError("full"), 503),
        (EngineDeadError("dead"), 503),
        (RuntimeError("secret internals"), 500),
    ],
)
def test_each_error_type_maps_to_one_status(exc: Exception, status: int) -> None:
    assert to_api_error(exc).status == status


USER = {"role": "user", "content": "hi"}


def test_queue_full_asks_to_retry_later() -> None:
    assert "Retry-After" in to_api_error(QueueFullError("full")).headers


def test_unexpected_errors_do_not_leak_their_message() -> None:
    body = to_api_error(RuntimeError("secret internals")).body()
    assert "secret" not in body["error"]["message"]


@pytest.mark.parametrize(
    "prompt,expected",
    [("hi", "hi"), (["hi"], "hi"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_completion_prompt_shapes(prompt: Any, expected: Any) -> None:
    assert parse_body(CompletionRequest, {"prompt": prompt}).prompt == expected


@pytest.mark.parametrize(
    "prompt", ["", [], ["a", "b"], [1, "a"], [True], 3, None, [[1], [2]], {"text": "hi"}]
)
def test_completion_rejects_bad_prompts(prompt: Any) -> None:
    with pytest.raises(APIError) as e:
        parse_body(CompletionRequest, {"prompt": prompt})
    assert e.value.status == 400 and e.value.param == "prompt"


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", "5"),
        ("max_tokens", 5.0),
        ("max_tokens", True),
        ("temperature", "0.5"),
        ("stream", 1),
        ("seed", 2**64),
        ("temperature", 2.5),
        ("priority", 1.5),
    ],
)
def test_numbers_and_strings_are_typed_strictly(field: str, value: Any) -> None:
    with pytest.raises(APIError) as e:
        parse_body(CompletionRequest, {"prompt": "hi", field: value})
    assert e.value.param == field


def test_unknown_fields_are_ignored() -> None:
    req = parse_body(CompletionRequest, {"prompt": "hi", "frobnicate": {"x": 1}})
    assert not hasattr(req, "frobnicate")


def test_integer_temperature_is_a_number() -> None:
    assert parse_body(CompletionRequest, {"prompt": "hi", "temperature": 0}).temperature == 0.0


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
        }
    )
    assert req.requested_max_tokens() == 7


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [
        (CompletionRequest, "suffix", "tail"),
        (ChatCompletionRequest, "store", True),
        (ChatCompletionRequest, "audio", {"voice": "alloy", "format": "wav"}),
        (ChatCompletionRequest, "modalities", ["text", "audio"]),
        (ChatCompletionRequest, "reasoning_effort", "high"),
        (ChatCompletionRequest, "prediction", {"type": "content", "content": "x"}),
        (ChatCompletionRequest, "web_search_options", {}),
        (ChatCompletionRequest, "functions", [{"name": "f"}]),
        (ChatCompletionRequest, "function_call", "auto"),
        (ChatCompletionRequest, "service_tier", "flex"),
        (ChatCompletionRequest, "top_logprobs", 3),
        (ChatCompletionRequest, "tool_choice", "required"),
    ],
)
def test_fields_that_cannot_be_honoured_are_a_400_naming_them(
    model: type, field: str, value: Any
) -> None:
    body = {"prompt": "hi"} if model is CompletionRequest else {"messages": [USER]}
    err = parse_body(model, {**body, field: value}).unsupported()
    assert err is not None and err.param == field and err.status == 400


def test_best_of_cannot_be_streamed_or_below_n() -> None:
    streamed = parse_body(CompletionRequest, {"prompt": "hi", "best_of": 3, "stream": True})
    assert streamed.unsupported().param == "best_of"
    below = parse_body(CompletionRequest, {"prompt": "hi", "n": 3, "best_of": 2})
    assert below.unsupported().param == "best_of"
    assert parse_body(CompletionRequest, {"prompt": "hi", "n": 3}).unsupported() is None


def test_chat_requires_a_list_of_message_objects() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": "hi"})


def test_defaults_match_the_design() -> None:
    parser = argparse.ArgumentParser()
    launch.add_serve_args(parser)
    args = parser.parse_args([])
    assert (args.host, args.port, args.kv_cache_memory, args.block_size) == (
        "127.0.0.1",
        8000,
        "2GiB",
        16,
    )
    assert args.shutdown_timeout == 30.0 and args.enable_prefix_cache and args.workers == 1


def test_more_than_one_worker_delegates_to_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    launcher = types.ModuleType("radixserve.router.launcher")
    launcher.serve_workers = lambda args: seen.append(args.workers) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "radixserve.router.launcher", launcher)
    parser = argparse.ArgumentParser()
    launch.add_serve_args(parser)
    assert launch.run_serve(parser.parse_args(["--workers", "3"])) == 0
    assert seen == [3]


def test_a_start_up_error_leaves_garbage_collection_on(tmp_path: Path) -> None:
    """run_serve turns collection off while it starts; an error on the way turns it back on."""
    parser = argparse.ArgumentParser()
    launch.add_serve_args(parser)
    args = parser.parse_args(["--api-key-tiers", str(tmp_path / "missing.json")])
    with pytest.raises(ValueError, match="cannot read API-key tiers"):
        run_serve(args)
    assert gc.isenabled()


def test_freezing_the_startup_heap_takes_live_objects_out_of_collections() -> None:
    alive = [0.5]  # a container the collector tracks
    gc.disable()  # as run_serve leaves it through start-up
    try:
        assert freeze_startup_heap() > 0  # (other threads may free frozen objects since)
        assert gc.isenabled()
        later = [0.5]
        scanned = gc.get_objects()  # what collections go through
        assert not any(o is alive for o in scanned)
        assert any(o is later for o in scanned)  # objects made afterwards still are
    finally:
        gc.unfreeze()
        gc.enable()


def test_startup_line_names_model_pool_and_url() -> None:
    engine = SimpleNamespace(
        num_blocks=100,
        block_size=16,
        dtype="float32",
        device="cpu",
        max_model_len=2048,
        quantization="int4",
        kv_cache_dtype="bfloat16",
        runner=SimpleNamespace(attn=SimpleNamespace(name="sdpa")),
    )
    line = startup_line(engine, "M", "127.0.0.1", 8000, True)
    parts = ("M", "float32", "cpu", "weights int4", "attention sdpa", "100 blocks", "1600 tokens")
    assert "KV pool (bfloat16) 100 blocks" in line
    for part in (*parts, "http://127.0.0.1:8000"):
        assert part in line
