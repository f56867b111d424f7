#!/usr/bin/env bash
# GPU check (issues 4 and 11), about 5 minutes on one GPU:
#   1. the CUDA tests (pytest -m gpu)
#   2. pdgpu compare with qwen3-0.6b geometry (random weights, bf16): parity of chunk and
#      layer with whole, traces checked by pdref
#   3. bench/engine_overlap.py with qwen3-0.6b at 8192 tokens / chunk 256, no link pacing,
#      plus the measured pinned copy bandwidth, in the same run.
#   4. the export-only curve (no compute, `pdgpu run --no-compute`): 0.1, 0.5, 1, 2, 4 GB of
#      qwen3-0.6b KV, whole vs chunked (256-token spans), interleaved, median of ratios.
# Results go to $OUT_DIR (default gpu_check_out/). Decoder: cuda:1 with two GPUs, else the
# same GPU (a host-staged round trip through pinned memory, the brief's copy path).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-gpu_check_out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| GPUs:', torch.cuda.device_count())" | tee "$OUT/device.txt"
DECODER=$("$PY" -c "import torch; print('cuda:1' if torch.cuda.device_count() > 1 else 'cuda:0')")

echo "== 1. CUDA tests"
timeout 120 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_pdgpu_gpu.py 2>&1 | tee "$OUT/pytest_gpu.txt"

echo "== 2. parity, qwen3-0.6b geometry, 2048 tokens, chunk 256 (decoder $DECODER)"
timeout 90 "$PY" -m pdgpu compare --model qwen3-0.6b --prompt 2048 --chunk 256 \
    --device cuda:0 --decoder-device "$DECODER" --trace-dir "$OUT" | tee "$OUT/compare.txt"
"$PY" -m pdref check "$OUT"/whole.jsonl "$OUT"/chunk.jsonl "$OUT"/layer.jsonl

echo "== 3. overlap benchmark, qwen3-0.6b, 8192 tokens, chunk 256 (decoder $DECODER)"
timeout 210 "$PY" bench/engine_overlap.py --model qwen3-0.6b --prompt 8192 --chunk 256 \
    --device cuda:0 --decoder-device "$DECODER" --link-gbps 0 --repeats 3 \
    --out "$OUT/engine_overlap.json" | tee "$OUT/engine_overlap.txt"

echo "== 4. export-only curve, qwen3-0.6b geometry, whole vs chunk 256 (decoder $DECODER)"
timeout 240 "$PY" bench/engine_overlap.py --model qwen3-0.6b --chunk 256 --export-only \
    --payloads 1e8,5e8,1e9,2e9,4e9 --device cuda:0 --decoder-device "$DECODER" --link-gbps 0 \
    --repeats 2 --out "$OUT/export_curve.json" | tee "$OUT/export_curve.txt"
