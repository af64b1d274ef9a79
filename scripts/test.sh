#!/usr/bin/env bash
# Set up (idempotent) and run every check: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check radixserve tests bench
ruff format --check radixserve tests bench
mypy radixserve/cache radixserve/engine
python -m pytest -q "$@"
