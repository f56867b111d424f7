"""pdsim demo's report.md: the device that really ran, what handoff and tail mean, and why."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from pdsim.demo_serve import ServeDemo, parity
from pdsim.fit.engine_runs import Measured
from pdsim.views.demo_report import report_md


def _pairs(tmp_path: Path, device: str, decoder: str, prefill_s: float) -> list:
    """Two engine runs whose traces' headers name the devices; handoff 1 s each."""
    pairs = []
    for mode in ("whole", "chunk"):
        trace = tmp_path / f"{mode}.jsonl"
        trace.write_text(json.dumps({"kind": "header", "version": 2, "source": "pdgpu",
                                     "device": device, "decoder_device": decoder}) + "\n")
        m = Measured(mode, str(trace), 1.0, 1.0 - prefill_s, prefill_s, 2**20, 7, True)
        pairs.append((m, {"handoff_s": 1.0, "tail_s": 0.01, "peak_staging_bytes": 2**20,
                          "chunk": 128}))
    return pairs


def _served(ok: bool) -> dict:
    summary = {"requests": 2, "ok": 2, "tokens_per_s": 10.0, "ttft_p50_s": 0.5,
               "itl_p50_s": 0.06, "handoff_p50_s": 0.5, "peak_pool_pages": 9, "leaked_pages": 0,
               "wall_s": 3.0}
    return {"config": attrs.asdict(ServeDemo(requests=2)),
            "runs": [{"mode": m, "summary": summary, "results": {}} for m in ("whole", "chunk")],
            "parity": {"all_ok": True, "modes_agree": ok, "reference_ok": True,
                       "reference_requests": ["q0"], "ok": ok}}


def _report(tmp_path, pairs, asked=None, requests=3) -> str:
    result = {"config": {"model": "small", "prompt": 1024, "chunks": (128, 256),
                         "device": asked, "requests": requests},
              "pairs": pairs, "sweeps": [], "checks": [], "wall_s": 12.0,
              "served": _served(True)}
    return report_md(result, tmp_path)


def test_report_names_the_device_from_the_traces_not_the_request(tmp_path):
    """With no --device given, the report still says which device ran (from the headers)."""
    text = _report(tmp_path, _pairs(tmp_path, "cpu", "cpu", 0.97))
    assert "ran on **cpu** (no --device: cuda if present)" in text


def test_report_defines_handoff_and_tail_and_explains_a_cpu_run(tmp_path):
    """Handoff and tail are defined; a CPU run says prefill's share and why it dominates."""
    text = _report(tmp_path, _pairs(tmp_path, "cpu", "cpu", 0.97))
    assert "**handoff**" in text and "**tail**: handoff minus prefill" in text
    assert "prefill is 97% of handoff" in text and "expected on a CPU" in text


def test_gpu_run_names_both_devices_and_skips_the_cpu_explanation(tmp_path):
    """A GPU producer with a CPU decoder is named as such; no CPU paragraph."""
    text = _report(tmp_path, _pairs(tmp_path, "cuda:0", "cpu", 0.6), asked="cuda")
    assert "ran on **cuda:0 -> decoder cpu**" in text
    assert "prefill is 60% of handoff" in text and "expected on a CPU" not in text


def test_one_request_reads_in_the_singular(tmp_path):
    """"1 request per run", never "1 requests"."""
    pairs = _pairs(tmp_path, "cpu", "cpu", 0.9)
    assert "1 request per run" in _report(tmp_path, pairs, requests=1)
    assert "3 requests per run" in _report(tmp_path, pairs, requests=3)


def test_served_run_section_says_failed_parity(tmp_path):
    """A served run whose modes disagree reads FAILED in the report, with the table."""
    pairs = _pairs(tmp_path, "cpu", "cpu", 0.9)
    result = {"config": {"model": "small", "prompt": 1024, "chunks": (128,), "device": None,
                         "requests": 3}, "pairs": pairs, "sweeps": [], "checks": [],
              "wall_s": 1.0, "served": _served(False)}
    text = report_md(result, tmp_path)
    assert "## Served run" in text and "Parity: FAILED" in text and "| chunk | 2/2 |" in text


def test_serve_parity_needs_every_mode_to_agree_and_every_request_ok():
    """One differing token in one mode, or one failed request, breaks the demo's parity."""
    lines = [{"req": "q0", "tokens": [1, 2], "output_tokens": 2}]
    demo = ServeDemo(references=0)

    def runs(chunk_output, status="ok"):
        return [{"results": {"q0": {"status": "ok", "output": [5, 6]}}},
                {"results": {"q0": {"status": status, "output": chunk_output}}}]
    assert parity(demo, lines, runs([5, 6]))["ok"]
    assert not parity(demo, lines, runs([5, 7]))["modes_agree"]
    assert not parity(demo, lines, runs([5, 6], "failed"))["ok"]
