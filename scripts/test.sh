#!/usr/bin/env bash
# Set up (idempotent) and run every check: lint, format, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
RADIXSERVE_EXTRAS=dev,ray,gpu bash scripts/setup.sh
# The dashboard's browser test drives Debian's chromium through its chromium-driver (no
# browser download at test time); without root or apt the test skips and says why.
if [ ! -x /usr/bin/chromedriver ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        chromium chromium-driver >/dev/null; } || echo "test.sh: chromium not installed" >&2
fi
. .venv/bin/activate
ruff check radixserve tests benchmarks
ruff format --check radixserve tests benchmarks
mypy radixserve
lint-imports  # the layer and no-cycle contracts of pyproject.toml [tool.importlinter]
python -m pytest -q "$@"
