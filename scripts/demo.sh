#!/usr/bin/env bash
# Set up, then run the main job on its built-in default (see README, Quick start):
# the engine under live pdref checks, calibration, simulator predictions side by side,
# chunk-size sweeps, every trace checked; all of it in one folder (default demo-out/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python.sh
"$PY" -m pdsim demo --out "${1:-demo-out}"
