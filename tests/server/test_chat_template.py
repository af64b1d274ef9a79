"""Chat templates: a model without one answers chat requests with a 400 that says so (its
completions still work); `--chat-template FILE` gives it one, rendered for every chat."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import write_tiny_model

pytestmark = pytest.mark.slow  # real `radixserve serve` subprocesses

TEMPLATE = "{% for m in messages %}w7 {{ m['content'] }} w8 {% endfor %}w9"


@pytest.fixture(scope="module")
def no_template_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a word-level tokenizer and no chat template."""
    return write_tiny_model(
        tmp_path_factory.mktemp("no-template") / "tiny", max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def plain(launch: Any, no_template_dir: Path) -> Iterator[Any]:
    with launch("--model", str(no_template_dir)) as server:
        yield server


def chat(server: Any, content: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_a_chat_to_a_model_without_a_template_is_a_400_that_says_so(plain: Any) -> None:
    r = chat(plain, "w3 w4")
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "no chat template" in message and "--chat-template" in message


def test_completions_still_work_without_a_template(plain: Any) -> None:
    # ignore_eos: the random weights may sample the word-level vocabulary's EOS first
    body = {"prompt": "w3 w4", "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(f"{plain.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_chat_template_file_renders_every_chat(
    launch: Any, no_template_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    with launch("--model", str(no_template_dir), "--chat-template", str(path)) as server:
        r = chat(server, "w3 w4")
    assert r.status_code == 200
    # "w7 w3 w4 w8 w9": five words of the word-level vocabulary, one token each
    assert r.json()["usage"]["prompt_tokens"] == 5
