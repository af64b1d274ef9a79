"""Schemathesis fuzzing of a real server from its own OpenAPI document (GET /openapi.json).

A bounded run of `benchmarks/fuzz.py` (see it for the checks) against a server over the tiny random
model: no 5xx, no response that breaks the document, every schema-violating body rejected.
The verdict is read from schemathesis' JSON report, not from its console output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("schemathesis")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
# The documented API, every operation of which the fuzzer must exercise; a route added to or
# dropped from the document must be added here or removed on purpose.
FUZZED = {
    "GET /health",
    "GET /version",
    "GET /metrics",
    "GET /v1/models",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/cache/stats",
    "GET /v1/cache/tree",
    "GET /v1/dashboard/stats",
    "POST /reset_prefix_cache",
}
ENDLESS = "GET /v1/cache/events"  # an endless event stream: bench/fuzz.py leaves it out


def documented_operations(url: str) -> set[str]:
    """'METHOD path' of every operation in the server's OpenAPI document."""
    doc = httpx.get(f"{url}/openapi.json", timeout=30).json()
    return {
        f"{method.upper()} {path}"
        for path, item in doc["paths"].items()
        for method in item
        if method in METHODS
    }


def test_fuzzing_from_the_openapi_document_finds_nothing(
    launch: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    report = tmp_path / "schemathesis.json"
    # schemathesis reads schemathesis.toml from its working directory: ask for its JSON report.
    (tmp_path / "schemathesis.toml").write_text(
        f"[reports.json]\npath = {json.dumps(str(report))}\n"
    )
    with launch("--model", str(tiny_model_dir), "--default-max-tokens", "8") as server:
        assert documented_operations(server.url) == FUZZED | {ENDLESS}
        run = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "fuzz.py"), "--url", server.url]
            + ["--max-examples", "10", "--seed", "16"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    verdict = json.loads(report.read_text())
    assert verdict["complete"] and verdict["exit_code"] == 0, verdict
    assert verdict["failures"] == [] and verdict["errors"] == [], verdict
    ops = verdict["operations"]
    n = len(FUZZED)
    assert (ops["total"], ops["selected"], ops["tested"]) == (n + 1, n, n), ops
    assert ops["errored"] == ops["skipped"] == 0, ops
    assert set(verdict["valid_rates"]) == FUZZED  # each one got generated requests
    phases = {name: p["status"] for name, p in verdict["phases"].items()}
    assert phases["coverage"] == phases["fuzzing"] == "success", phases
    cases = verdict["test_cases"]
    assert cases["generated"] >= 100 and cases["with_failures"] == cases["errored"] == 0, cases
