"""The `radixserve` console script: offline generate/chat and clear errors."""

from __future__ import annotations

import pytest

from tests.support import run_cli

pytestmark = pytest.mark.slow  # each case starts the CLI in a subprocess


def test_help_lists_every_command() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for cmd in ("serve", "route", "bench", "analyze", "generate", "chat"):
        assert cmd in out.stdout


def test_chat_answers_with_the_default_model() -> None:
    # Not "What is the capital of France?": its first token is a near tie (0.08 apart in
    # float32) that int8 activations flip (the int8-vnni default on AVX-512 VNNI CPUs without
    # AMX answers "L'Étoile, ...", as llama.cpp's server does on the same GGUF there).
    out = run_cli("chat", "Who wrote Hamlet?", "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert "Shakespeare" in out.stdout


def test_unknown_model_is_a_clear_error() -> None:
    out = run_cli("generate", "hi", "--model", "/no/such/model")
    assert out.returncode == 2
    assert "not found" in out.stderr and "Traceback" not in out.stderr


def test_impossible_sampling_parameters_are_a_clear_error() -> None:
    out = run_cli("generate", "hi", "--temperature", "-1")
    assert out.returncode == 2
    assert "temperature" in out.stderr and "Traceback" not in out.stderr
