#!/usr/bin/env bash
# Set up (idempotent) and start the server on the default model. Extra args go to `radixserve serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/radixserve serve "$@"
