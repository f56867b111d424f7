#!/usr/bin/env bash
# `pdgpu serve --http` under NVIDIA's aiperf (issue 39 item 5): installs aiperf into its own
# environment (build/aiperf-env, or $AIPERF_ENV) once, then runs bench/load_tool.py with the
# project's .venv: a checkpoint with a trained byte-level BPE tokenizer, the issue's
# fixed-length streamed chat workload (512 in, 32 out, 48 requests) at concurrency 4 and 8,
# aiperf's figures per concurrency; exit 1 if any request failed. Not in the default suite.
#   bash bench/load_tool.sh [--requests N] [--concurrency C ...] [--isl N] [--osl N]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
env=${AIPERF_ENV:-$root/build/aiperf-env}
if [ ! -x "$env/bin/aiperf" ]; then
    python3 -m venv "$env"
    "$env/bin/pip" install -q --disable-pip-version-check "aiperf==${AIPERF_VERSION:-0.13.0}"
fi
cd "$root"
exec .venv/bin/python bench/load_tool.py --aiperf "$env/bin/aiperf" "$@"
