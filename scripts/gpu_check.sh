#!/usr/bin/env bash
# GPU check (issues 4, 9, 11, 24, 33 and 34), about 6 minutes on one GPU without the hybrid
# steps of issue 33 (in 1 and 2c) and issue 34's served figures (2e, 5c), none of them timed
# on a GPU yet; each step has its own time limit, together 845 s (905 with NIXL):
#   1. the CUDA tests (pytest -m gpu): every one must run, a skipped one fails the check
#      (the engine on CUDA, the attention kernels in bf16 and float32, and the hybrid
#      families' tokens against transformers on CUDA, issue 33; issue 34: the decode step
#      replayed as a CUDA graph gives the eager step's tokens, a request's decode logits are
#      bit-identical alone and in a batch on CUDA (bf16, fp32), the op counts of 2d with
#      every dispatched op counted)
#   1b. pdgpu serve on CUDA (tests/test_pdgpu_serve_gpu.py, pytest -m gpu): served tokens
#      equal pdgpu generate on cuda:0 in whole/chunk/layer with 1 and 2 producers, --verify;
#      a killed producer does not hang the decoder. With two GPUs the decoder is on cuda:1
#      and KV crosses over NCCL; with one, NCCL cannot join two processes on one GPU, so the
#      KV crosses through page-locked shared host memory (lane shm-pinned: the NCCL path is
#      then NOT checked; the step prints which lane ran, and the tests assert it); and
#      tests/test_pdgpu_serve_shm.py's GPU test: one GPU serves through shm-pinned; and
#      tests/test_pdgpu_serve_graphs.py's: served tokens with the decode step replayed as CUDA
#      graphs (--cuda-graphs on) equal the eager step's (off) and generate's
#   2. pdgpu compare with qwen3-0.6b geometry (random weights, bf16): parity of chunk and
#      layer with whole, traces checked by pdref
#   2b. bench/kernel_speed.py: pdgpu prefill (one chunk, chunks of 256) and a decode step
#      (batch 16, contexts 1-4k) against transformers, same weights, same run; the GPU
#      targets (one chunk <= 1.0x, chunks <= 1.3x, decode step <= 8 ms, eager and replayed as
#      a CUDA graph: the ITL at batch 16) printed with each
#   2c. bench/kernel_speed.py --family qwen3_5 and gemma3: the same, on hybrids of the
#      preset's sizes saved by transformers (decode: a real batch of 256..1024-token prompts)
#   2d. kernel ops per layer on the device (bench/kernel_speed.py --count, issue 34): decode
#      step of batch 16 <= 20, prefill chunk (first, later; digests on) <= 25, host syncs and
#      host-made tensors in the step 0, each printed with its target
#   2e. the served ITL at batch 16 (bench/serve_graphs.py, issue 34): pdgpu serve of 16
#      requests at once, the decode step eager (--cuda-graphs off) and replayed (on), side by
#      side in alternating rounds: the median full-batch step with its target (8 ms, goal 5)
#   3. bench/engine_overlap.py with qwen3-0.6b at 8192 tokens / chunk 256, no link pacing,
#      plus the measured pinned copy bandwidth, in the same run.
#   4. the export-only curve (no compute, `pdgpu run --no-compute`): 0.1, 0.5, 1, 2 GB of
#      qwen3-0.6b KV, whole vs chunked (256-token spans), interleaved, median of ratios.
#   5. KV bytes/s between two processes on cuda:0 (bench/serve.py's lane probe, 64 MB
#      messages): shm-pinned (d2h into page-locked shared memory, h2d out of it) and
#      gloo-staged, each against the pinned copy bandwidth of the same bytes (target >= 0.5);
#      and nixl (VRAM to VRAM where UCX can) when its package is installed, as in step 1b.
#   5b. with nixl: which UCX transport carried the decoder's READ (UCX_PROTO_INFO's tables,
#      in ucx_read.txt: cuda_ipc is device to device, cuda_copy or cma went through the host)
#   5c. with nixl: a chunk span's digests (28 layers x 256 tokens) READ into the landing
#      buffer registered once against a VRAM tensor registered per read (bench/nixl_landing.py)
# Results go to $OUT_DIR (default gpu_check_out/, or gpu_check_out/dry-run/), with each
# step's seconds in timings.txt.
# Decoder: cuda:1 with two GPUs, else the same GPU (a host-staged round trip through pinned
# memory, the brief's copy path). Without CUDA it stops at once, exit 1.
#
#   scripts/gpu_check.sh --dry-run   # no GPU: the same steps on CPU at toy sizes (tiny model,
#                                    # KB payloads; the CUDA tests only collected), so the
#                                    # commands and their options are known to work (~3 min;
#                                    # each step's limit x3: processes start slowly on a busy CPU)
# A failed step stops the check, unless KEEP_GOING=1: then every step runs (a first run on a
# lent GPU gets all it can from one call), failures are listed in failed.txt, and it exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=0
case "${1:-}" in
    "") ;;
    --dry-run) DRY=1 ;;
    *) echo "gpu_check: unknown option ${1} (only --dry-run)" >&2; exit 2 ;;
esac
OUT=${OUT_DIR:-gpu_check_out$([ "$DRY" = 1 ] && echo /dry-run)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 0 ]; then  # before anything is written
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device (use --dry-run on a CPU machine)')"
fi
mkdir -p "$OUT"
: > "$OUT/timings.txt"
rm -f "$OUT/failed.txt"

failed() {  # failed NAME: stop, or with KEEP_GOING=1 note it and go on
    echo "gpu_check: step $1 failed" | tee -a "$OUT/failed.txt" >&2
    [ "${KEEP_GOING:-0}" = 1 ] || exit 1
}

step() {  # step SECONDS NAME COMMAND...: run it under a time limit, output to $OUT/NAME.txt
    local limit=$(($1 * LIMIT_SCALE)) name=$2 start=$SECONDS status=0
    shift 2
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt" || status=$?
    echo "$name $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/timings.txt"
    [ "$status" = 0 ] || failed "$name"
}

if [ "$DRY" = 1 ]; then
    DEV=cpu DECODER=cpu MODEL=tiny PROMPT=256 CHUNK=32 COMPARE_PROMPT=128
    PAYLOADS=2e4,5e4,1e5,2e5,4e5 REPEATS=1 CURVE_REPEATS=1 LANE_MB=4 LANE_ROUNDS=1
    KERNEL_CONTEXTS=16:64 HYBRID_CONTEXTS=16:32
    # CPU: eager twice, 4 at once (16 tiny prompts' prefills spread their admissions)
    SERVED=(--batch 4 --contexts 16:64 --output-tokens 32 --graphs off,auto --rounds 1)
    TESTS=(--collect-only)
    LIMIT_SCALE=3  # the limits bound a GPU run; a dry run's processes start on a shared CPU
    echo "device: cpu (dry run: toy sizes, nothing measured)" | tee "$OUT/device.txt"
else
    "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| GPUs:', torch.cuda.device_count())" | tee "$OUT/device.txt"
    DEV=cuda:0 MODEL=qwen3-0.6b PROMPT=8192 CHUNK=256 COMPARE_PROMPT=2048
    DECODER=$("$PY" -c "import torch; print('cuda:1' if torch.cuda.device_count() > 1 else 'cuda:0')")
    PAYLOADS=1e8,5e8,1e9,2e9 REPEATS=3 CURVE_REPEATS=2 LANE_MB=64 LANE_ROUNDS=2
    KERNEL_CONTEXTS=1024:4096 HYBRID_CONTEXTS=256:1024
    SERVED=(--batch 16 --contexts 1024:4096 --output-tokens 256 --graphs off,on --rounds 2)
    TESTS=(-rs)
    LIMIT_SCALE=1
fi

no_skips() {  # no_skips NAME: a skipped CUDA test fails the check
    if [ "$DRY" = 0 ] && grep -qi "skipped" "$OUT/$1.txt"; then
        echo "gpu_check: CUDA tests were skipped (see $OUT/$1.txt)" >&2
        failed "$1 (skips)"
    fi
}

echo "== 1. CUDA tests"
step 90 pytest_gpu "$PY" -m pytest -m gpu -q -p no:cacheprovider "${TESTS[@]}" tests/test_pdgpu_gpu.py \
    tests/test_pdgpu_attention.py tests/test_pdgpu_hybrid.py tests/test_pdgpu_decode_graph.py \
    tests/test_pdgpu_op_count.py
no_skips pytest_gpu

case "$DRY:$DECODER" in
    1:*) LANE="dry run: collected only" ;;
    0:cuda:1) LANE="decoder cuda:1: KV over NCCL" ;;
    *) LANE="one GPU: KV staged through host memory, the NCCL path NOT checked" ;;
esac
echo "== 1b. pdgpu serve on CUDA ($LANE)"
# the NIXL lane (issue 26) where its package is installed (the dev extra has it): its GPU test
# serves through VRAM rings; step 5 measures it beside shm and gloo
NIXL=()
if "$PY" -c "import nixl_cu13" 2>/dev/null; then NIXL=(tests/test_pdgpu_serve_nixl.py); fi
step 90 serve_gpu "$PY" -m pytest -m gpu -q -p no:cacheprovider "${TESTS[@]}" \
    tests/test_pdgpu_serve_gpu.py tests/test_pdgpu_serve_shm.py tests/test_pdgpu_serve_graphs.py \
    "${NIXL[@]}"
no_skips serve_gpu

echo "== 2. parity, $MODEL geometry, $COMPARE_PROMPT tokens, chunk $CHUNK (decoder $DECODER)"
step 35 compare "$PY" -m pdgpu compare --model "$MODEL" --prompt "$COMPARE_PROMPT" \
    --chunk "$CHUNK" --device "$DEV" --decoder-device "$DECODER" --trace-dir "$OUT"
"$PY" -m pdref check "$OUT"/whole.jsonl "$OUT"/chunk.jsonl "$OUT"/layer.jsonl || failed "pdref check"

echo "== 2b. kernels against transformers, $MODEL, $PROMPT tokens, chunk $CHUNK, decode batch 16"
step 60 kernels "$PY" bench/kernel_speed.py --device "$DEV" --model "$MODEL" --prompt "$PROMPT" \
    --chunk "$CHUNK" --contexts "$KERNEL_CONTEXTS" --repeats "$REPEATS" --profile

for family in qwen3_5 gemma3; do
    echo "== 2c. kernels against transformers, $MODEL sizes as $family, $PROMPT tokens"
    step 60 "kernels_$family" "$PY" bench/kernel_speed.py --device "$DEV" --model "$MODEL" \
        --family "$family" --prompt "$PROMPT" --chunk "$CHUNK" --contexts "$HYBRID_CONTEXTS" \
        --repeats "$REPEATS"
done

echo "== 2d. kernel ops per layer on $DEV, $MODEL: decode batch 16, chunk $CHUNK (issue 34)"
step 60 op_counts "$PY" bench/kernel_speed.py --count --device "$DEV" --model "$MODEL" \
    --chunk "$CHUNK" --contexts "$KERNEL_CONTEXTS" --batch 16

echo "== 2e. served ITL at batch 16, $MODEL, eager vs CUDA graphs (decoder $DECODER, issue 34)"
step 180 served_itl "$PY" bench/serve_graphs.py --model "$MODEL" --device "$DEV" \
    --decoder-device "$DECODER" --chunk "$CHUNK" "${SERVED[@]}"

echo "== 3. overlap benchmark, $MODEL, $PROMPT tokens, chunk $CHUNK (decoder $DECODER)"
step 80 engine_overlap "$PY" bench/engine_overlap.py --model "$MODEL" --prompt "$PROMPT" \
    --chunk "$CHUNK" --device "$DEV" --decoder-device "$DECODER" --link-gbps 0 \
    --repeats "$REPEATS" --out "$OUT/engine_overlap.json"

echo "== 4. export-only curve, $MODEL geometry, whole vs chunk $CHUNK (decoder $DECODER)"
step 55 export_curve "$PY" bench/engine_overlap.py --model "$MODEL" --chunk "$CHUNK" \
    --export-only --payloads "$PAYLOADS" --device "$DEV" --decoder-device "$DECODER" \
    --link-gbps 0 --repeats "$CURVE_REPEATS" --out "$OUT/export_curve.json"

echo "== 5. KV between processes on $DEV: shm vs gloo lanes, against a same-size copy"
step 75 kv_lane "$PY" bench/serve.py --modes "" --lanes "gloo,shm${NIXL:+,nixl}" --device "$DEV" \
    --lane-mb "$LANE_MB" --lane-messages 20 --rounds "$LANE_ROUNDS"
if [ "${#NIXL[@]}" -gt 0 ]; then
    echo "== 5b. which UCX transport carried the NIXL lane's READ on $DEV (UCX_PROTO_INFO)"
    step 30 ucx_transport env UCX_PROTO_INFO=y "$PY" -c "from pdgpu.serve.lane_probe import \
transfer_rate; print('nixl B/s, lane:', transfer_rate('nixl', 1 << 22, 12, '$DEV', warm=2, staged=True))"
    grep -A5 "remote memory read" "$OUT/ucx_transport.txt" | grep -E "read|zero-copy|copy" \
        | sed 's/^\[[^]]*\] \[[^]]*\] *//' | sort | uniq -c | tee "$OUT/ucx_read.txt" || true
    echo "== 5c. a span's digests READ over NIXL on $DEV: landing buffer vs a fresh registration each"
    step 30 nixl_landing "$PY" bench/nixl_landing.py --device "$DEV" --rows 7168 --reads 400
fi
if [ -s "$OUT/failed.txt" ]; then
    echo "gpu_check: FAILED steps, results in $OUT/:"; cat "$OUT/failed.txt"; exit 1
fi
echo "gpu_check: done, results in $OUT/"
