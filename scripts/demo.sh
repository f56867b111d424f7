#!/usr/bin/env bash
# Set up, then run the main job on its built-in default (see README, Quick start).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
OUT=${1:-demo-out}
mkdir -p "$OUT"
echo "== pdref check: the shipped legal example traces"
"$PY" -m pdref check specs/examples/legal-*.jsonl
echo "== pdref check: an illegal example is refused with its code (exit 1 expected)"
"$PY" -m pdref check specs/examples/illegal-COV-2-overlapping-spans-in-flight.jsonl || true
