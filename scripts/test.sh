#!/usr/bin/env bash
# Set up, lint, and run the default test suite (fast; slow and GPU suites are opt-in).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m pytest "$@"
