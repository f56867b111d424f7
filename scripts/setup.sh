#!/usr/bin/env bash
# Install the project and its dependencies into the current Python (idempotent).
# torch is pinned first to the CPU build 2.13.0: an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    "$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
