"""Schemathesis fuzzing of a real server from its own OpenAPI document (GET /openapi.json).

A bounded run of `benchmarks/fuzz.py` (see it for the checks) against a server over the tiny random
model: no 5xx, no response that breaks the document, every schema-violating body rejected.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("schemathesis")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_fuzzing_from_the_openapi_document_finds_nothing(launch: Any, tiny_model_dir: Path) -> None:
    with launch("--model", str(tiny_model_dir), "--default-max-tokens", "8") as server:
        run = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "fuzz.py"), "--url", server.url]
            + ["--max-examples", "10", "--seed", "16"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "No issues found" in run.stdout or "passed" in run.stdout
