#!/usr/bin/env bash
# Set up, lint, and run the default test suite (fast; slow and GPU suites are opt-in).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python.sh
"$PY" -m ruff check .
"$PY" -m pytest "$@"
