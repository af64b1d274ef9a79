"""benchmarks/gpu_check.py's CPU smoke mode runs end to end, with the server packages absent (the
GPU machine it is written for has none of them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the device machine lacks; the engine path must not import any of it.
ABSENT = ("fastapi", "uvicorn", "starlette", "gguf", "openai", "ray", "schemathesis")

RUN = f"""
import runpy, sys
sys.modules.update(dict.fromkeys({ABSENT!r}))  # `import fastapi` now raises ImportError
sys.argv = ["gpu_check.py", "--device", "cpu", "--quick"]
runpy.run_path({str(ROOT / "benchmarks" / "gpu_check.py")!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_gpu_check_smoke_run_prints_every_row_without_server_packages() -> None:
    r = subprocess.run(
        [sys.executable, "-c", RUN], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    checks = [line.split(" | ")[0].removeprefix("| ") for line in table[1:]]
    assert len(checks) == 13, r.stdout
    for start in ("logits vs transformers, float32", "cold TTFT", "hit TTFT", "decode tok/s"):
        assert any(c.startswith(start) for c in checks), start
    fp32 = next(line for line in table if "logits vs transformers, float32" in line)
    diff = float(re.search(r"max abs diff ([0-9.e+-]+)", fp32).group(1))  # type: ignore[union-attr]
    assert diff < 1e-4
    on_off = [line for line in table if line.startswith("| greedy cache on == off, ")]
    assert [line.split(", ")[1].split(" ")[0] for line in on_off] == ["float32", "bfloat16"], table
    for line in on_off:
        assert line.endswith("| yes |"), line
