#!/usr/bin/env bash
# Install the project and its dependencies (idempotent) into the project's virtual environment
# .venv, created here on first use (PYTHON=/path/to/python installs into that one instead).
# torch is pinned to 2.13.0 and installed first. Which build pip picks depends on the index:
# this project's machines carry the CPU build of 2.13.0 on local disk, and pip takes it; on
# PyPI the default Linux wheel is the CUDA build (several GB). On another machine without a
# GPU, ask for the CPU build: TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
# Each of the four steps says what it does and how many seconds it took: a first run spends
# minutes in pip and the compile, and a silent one reads as a hang.
SETUP_T0=$EPOCHREALTIME
step() { STEP=$1; STEP_T0=$EPOCHREALTIME; echo "setup: [$1] $2"; }
step_done() {
    awk -v name="$STEP" -v a="$STEP_T0" -v b="$EPOCHREALTIME" -v what="$1" \
        'BEGIN { printf "setup: [%s] %s in %.1f s\n", name, what, b - a }'
}
step "1/4 venv" "the virtual environment"
if [ -z "${PYTHON:-}" ] && [ ! -x "$PY" ]; then
    echo "setup: creating the virtual environment .venv"
    python3 -m venv .venv
    step_done "created .venv"
else
    step_done "reusing $PY"
fi
echo "setup: installing into $("$PY" -c 'import sys; print(sys.prefix)')"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
step "2/4 torch" "torch 2.13.0 (a first install downloads it: minutes)"
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    "${PIP[@]}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "torch==2.13.0"
    step_done "installed"
else
    step_done "already installed"
fi
step "3/4 project" "the project, editable, with its dev extras (pip)"
"${PIP[@]}" -e ".[dev]"
step_done "installed"
# the simulator's hot modules, compiled with Cython (pdref/accel.py). A failed compile fails
# set-up: passed over, it would leave every run slower and the compiled-equals-Python tests
# with nothing to compare. PD_PURE_PYTHON=1 asks for pure Python: no compile at all.
step "4/4 compile" "the simulator's hot modules with Cython (only those whose source changed)"
if [ -n "${PD_PURE_PYTHON:-}" ]; then
    echo "setup: PD_PURE_PYTHON is set: the simulator's modules run as Python (no compile)"
    step_done "skipped"
elif ! "$PY" scripts/build_compiled.py; then
    echo "setup: FAILED to compile the simulator's modules (the reason is above). Install a C" \
         "compiler (and Python's headers), or set PD_PURE_PYTHON=1 to run them as Python." >&2
    exit 1
else
    step_done "compiled"
fi
STEP=total STEP_T0=$SETUP_T0 step_done "set-up done"
