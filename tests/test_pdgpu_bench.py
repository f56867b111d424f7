"""bench/engine_overlap.py runs end to end on a tiny workload and reports every ratio."""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "engine_overlap.py"
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"


def test_overlap_bench_reports_ratios_and_targets(capsys, tmp_path):
    """One round on `tiny`: JSON with medians per mode, the ratios, targets and bandwidth."""
    main = runpy.run_path(str(BENCH))["main"]
    out = tmp_path / "bench.json"
    args = ["--model", "tiny", "--prompt", "64", "--chunk", "16", "--repeats", "1",
            "--link-gbps", "0.002", "--json", "--out", str(out)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out.read_text())
    assert set(result["median"]) == {"whole", "chunk", "layer", "oneshot", "export_whole",
                                     "export_chunk"}
    assert result["ratios"]["chunk_staging_spans"] == 2.0
    assert result["ratios"]["export_chunk_over_whole"] > 0
    assert {m["threads"] for m in result["median"].values()} == {result["threads"]}
    assert result["median"]["chunk"]["tail_s"] < result["median"]["whole"]["tail_s"]
    assert result["copy_bandwidth"]["d2h_gbps"] > 0
    fracs = [m["check_frac"] for m in result["median"].values()]
    assert result["ratios"]["live_check_frac"] == max(fracs) > 0  # the worst configuration
    assert result["ratios"]["audit_lag_max_s"] >= result["ratios"]["audit_lag_p50_s"] > 0


def test_overlap_bench_runs_a_hybrid_and_reports_the_states_tail(capsys):
    """--family qwen3_5 (one round, `tiny`'s sizes): the compute configurations only (no
    export: its payload is dense K/V), the layer / chunk ratios and each mode's state tail."""
    main = runpy.run_path(str(BENCH))["main"]
    args = ["--model", "tiny", "--family", "qwen3_5", "--prompt", "64", "--chunk", "16",
            "--repeats", "1", "--link-gbps", "0.002", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["family"], set(result["median"])) == (
        "qwen3_5", {"whole", "chunk", "layer", "oneshot"})
    assert result["ratios"]["layer_handoff_over_chunk"] > 0
    assert result["ratios"]["layer_tail_over_chunk"] > 0
    assert all(m["state_tail_s"] != 0 for m in result["median"].values())  # a state crossed


def test_export_curve_reports_whole_and_chunked_per_payload(capsys):
    """--export-only --payloads: one row per payload with both times and their ratio."""
    main = runpy.run_path(str(BENCH))["main"]
    args = ["--model", "tiny", "--chunk", "16", "--repeats", "1", "--link-gbps", "0.01",
            "--export-only", "--payloads", "2e4,6e4", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["export_curve"]
    assert [r["payload"] for r in rows] == [20000, 60000]
    assert all(r["whole_s"] > 0 and r["chunk_s"] > 0 and r["chunk_over_whole"] > 0 for r in rows)
    assert rows[1]["whole_s"] > rows[0]["whole_s"]  # three times the bytes on a paced link


def _gpu_check(tmp_path, *args, **env):
    return subprocess.run(["bash", str(GPU_CHECK), *args], capture_output=True, text=True,
                          env={**os.environ, "OUT_DIR": str(tmp_path / "out"),
                               "PYTHON": sys.executable, **env},
                          timeout=300)


def test_gpu_check_parses_and_stops_loudly_without_cuda(tmp_path):
    """scripts/gpu_check.sh is valid bash; with no CUDA device it exits 1 saying so and
    writes nothing; an unknown option is exit 2."""
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)], timeout=60).returncode == 0
    run = _gpu_check(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert run.returncode == 1 and "no CUDA device" in run.stderr
    assert not (tmp_path / "out").exists()
    assert _gpu_check(tmp_path, "--fast").returncode == 2


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_on_cpu(tmp_path):
    """--dry-run: every step's command runs on CPU at toy sizes (CUDA tests collected only):
    checked traces, the overlap bench's JSON, a five-point export curve and the KV lanes'
    bytes/s, each step timed; with nixl installed, the UCX transport its READ took."""
    run = _gpu_check(tmp_path, "--dry-run")
    assert run.returncode == 0, run.stderr[-2000:]
    out = tmp_path / "out"
    steps = [line.split()[0] for line in (out / "timings.txt").read_text().splitlines()]
    nixl = importlib.util.find_spec("nixl_cu13") is not None
    assert steps == ["pytest_gpu", "serve_gpu", "compare", "kernels", "kernels_qwen3_5",
                     "kernels_gemma3", "op_counts", "served_itl", "engine_overlap", "export_curve",
                     "kv_lane"] + ["ucx_transport", "nixl_landing"] * nixl
    if nixl:  # which UCX transport carried the NIXL READ, from UCX's own tables
        assert "remote memory read" in (out / "ucx_read.txt").read_text()
        assert "landing / fresh:" in (out / "nixl_landing.txt").read_text()
    collected = (out / "pytest_gpu.txt").read_text().split("test_pdgpu_gpu.py: ")[1]
    assert int(collected.split()[0]) >= 10  # the CUDA tests, collected
    served = (out / "serve_gpu.txt").read_text().split("test_pdgpu_serve_gpu.py: ")[1]
    assert int(served.split()[0]) == 7  # 3 modes x 1, 2 producers, and the killed producer
    assert {p.name for p in out.glob("*.jsonl")} == {"whole.jsonl", "chunk.jsonl", "layer.jsonl"}
    assert "targets" in json.loads((out / "engine_overlap.json").read_text())
    curve = json.loads((out / "export_curve.json").read_text())["export_curve"]
    assert len(curve) == 5 and all(r["chunk_s"] > 0 and r["whole_s"] > 0 for r in curve)
    kernels = (out / "kernels.txt").read_text()
    assert "prefill_one_chunk" in kernels and "decode_step" in kernels
    counts = (out / "op_counts.txt").read_text()  # issue 34: ops per layer beside targets
    assert "decode_step" in counts and "target <= 20: ok" in counts and "0 host syncs" in counts
    itl = (out / "served_itl.txt").read_text()  # issue 34: eager beside replayed
    assert "| off | eager |" in itl and "| auto | eager |" in itl  # auto: eager on CPU
    assert "<= 8 ms (goal 5)" in itl and "auto/off per round" in itl
    lanes = (out / "kv_lane.txt").read_text()
    assert "| shm |" in lanes and "| gloo |" in lanes and "of memcpy" in lanes


@pytest.mark.parametrize("keep_going", [False, True])
def test_gpu_check_stops_at_a_failed_step_unless_keep_going(tmp_path, keep_going):
    """A failing step stops the check (exit 1); with KEEP_GOING=1 every step still runs and
    each failure is listed in failed.txt, and the check still exits 1."""
    env = {"PYTHON": "false", **({"KEEP_GOING": "1"} if keep_going else {})}
    run = _gpu_check(tmp_path, "--dry-run", **env)
    out = tmp_path / "out"
    steps = [line.split()[0] for line in (out / "timings.txt").read_text().splitlines()]
    failed = (out / "failed.txt").read_text().splitlines()
    assert run.returncode == 1
    if keep_going:
        kernels = ["kernels", "kernels_qwen3_5", "kernels_gemma3", "op_counts", "served_itl"]
        assert steps == ["pytest_gpu", "serve_gpu", "compare", *kernels, "engine_overlap",
                         "export_curve", "kv_lane"]
        names = ["pytest_gpu", "serve_gpu", "compare", "pdref check", *kernels,
                 "engine_overlap", "export_curve", "kv_lane"]
        assert failed == [f"gpu_check: step {name} failed" for name in names]
        assert "FAILED steps" in run.stdout
    else:
        assert steps == ["pytest_gpu"] and failed == ["gpu_check: step pytest_gpu failed"]


def test_kernel_speed_bench_reports_ratios_and_a_profile(capsys):
    """bench/kernel_speed.py on `tiny`: pdgpu and transformers side by side, the three
    ratios, and a profile of the chunked prefill and the decode step."""
    pytest.importorskip("transformers")
    main = runpy.run_path(str(ROOT / "bench" / "kernel_speed.py"))["main"]
    args = ["--model", "tiny", "--prompt", "64", "--chunk", "16", "--batch", "3",
            "--contexts", "8:300", "--repeats", "1", "--profile", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("prefill_one_chunk", "prefill_chunked", "decode_step"):
        assert out[key] > 0
    assert out["ours_decode_s"] > 0 and out["hf_decode_s"] > 0
    assert set(out["profile"]) == {"ours_chunked", "ours_decode"}
    assert all(row["aten_calls"] > 0 for row in out["profile"].values())


def test_ledger_path_bench_runs_its_lives_through_the_ledger():
    """bench/ledger_path.py (the A/B recipe of docs/architecture.md) runs against today's Ledger."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ledger_path.py"), "20"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["checks"] >= 20 * 8 and figures["per_life_us"] > 0


def test_decode_memory_bench_times_joins_a_step_and_leaves():
    """bench/decode_memory.py (docs/graph-step.md's side-by-side recipe) runs on `tiny`."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "decode_memory.py"), "--model",
                          "tiny", "--requests", "3", "--contexts", "8:300", "--steps", "2",
                          "--repeats", "1", "--json"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(figures) == {"join_s", "step_s", "leave_s"} and min(figures.values()) > 0
