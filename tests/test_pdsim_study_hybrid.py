"""`pdsim study-hybrid`: a hybrid's handoff beside its all-full twin and a dense model, and
overlap's gain over whole copy on each; its report, plot, CSV and checked traces."""

from __future__ import annotations

import csv

import pytest

from pdref.check import check_file
from pdref.models import load_model
from pdsim.cli import main
from pdsim.study_hybrid import HybridGrid, run_grid

GRID = HybridGrid(models=("qwen3-0.6b", "qwen3.5-27b", "gemma-3-27b"), hws=("h200",),
                  engines=("production",), prompts=(4096, 16384), concurrencies=(1,),
                  requests=3, output_tokens=4, chunk=512)


@pytest.fixture(scope="module")
def rows():
    return run_grid(GRID, jobs=1, traces=None)


def _row(rows, model, prompt, mode="whole"):
    return next(r for r in rows if (r["model"], r["prompt"], r["mode"]) == (model, prompt, mode))


def test_a_hybrid_hands_off_what_its_layer_kinds_keep(rows):
    """Between two prompts the handoff grows by the full layers' K/V alone: a linear layer's
    state and a sliding layer's window do not grow; every mode hands off the same bytes."""
    for model, full in (("qwen3.5-27b", 16), ("gemma-3-27b", 10)):
        spec = load_model(model)
        kv_token_layer = 2 * spec.kv_heads * spec.head_dim * spec.dtype_bytes
        grown = _row(rows, model, 16384)["bytes_per_request"] - \
            _row(rows, model, 4096)["bytes_per_request"]
        assert grown == (16384 - 4096) * full * kv_token_layer
        assert len({_row(rows, model, 16384, m)["bytes_per_request"]
                    for m in ("whole", "chunk", "layer")}) == 1


def test_the_twin_hands_off_every_layer_and_the_gap_widens(rows):
    """Each hybrid's all-full twin hands off more, by a ratio that grows with the prompt."""
    for model in ("qwen3.5-27b", "gemma-3-27b"):
        short, long = _row(rows, model, 4096), _row(rows, model, 16384)
        assert 1.0 < short["twin_bytes_ratio"] < long["twin_bytes_ratio"]
        assert _row(rows, model + "+full", 16384)["bytes_per_request"] == pytest.approx(
            long["bytes_per_request"] * long["twin_bytes_ratio"], rel=1e-12)
    assert _row(rows, "qwen3-0.6b", 4096)["twin_bytes_ratio"] is None  # dense: no twin


def test_overlap_pays_less_on_a_hybrid_than_on_its_twin(rows):
    """One request at a time: chunk overlap gains over whole on every model, less on a
    hybrid (a smaller tail) than on its all-full twin, most on the small dense model."""
    for prompt in GRID.prompts:
        dense = _row(rows, "qwen3-0.6b", prompt, "chunk")["gain_pct"]
        for model in ("qwen3.5-27b", "gemma-3-27b"):
            hybrid = _row(rows, model, prompt, "chunk")
            twin = _row(rows, model + "+full", prompt, "chunk")
            assert 0.0 < hybrid["gain_pct"] < twin["gain_pct"] < dense
            assert hybrid["tail_share_pct"] < twin["tail_share_pct"]


def test_command_writes_report_plot_csv_and_legal_traces(tmp_path, capsys):
    """The command writes report.md (both questions, the PNG linked), hybrid.csv with a row
    per configuration, and a legal trace of each hybrid in each mode at the longest prompt."""
    out = tmp_path / "h"
    argv = ["study-hybrid", "--hw", "h200", "--prompts", "2048,8192", "--concurrency", "1",
            "--requests", "2", "--output-tokens", "2", "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    rows = list(csv.DictReader((out / "hybrid.csv").open()))
    assert len(rows) == 5 * 2 * 3  # 3 models and 2 twins, 2 prompts, 3 modes
    text = (out / "report.md").read_text()
    assert "## How much smaller is the handoff" in text and "## Does overlap still pay?" in text
    assert "(study-hybrid-production.png)" in text
    assert (out / "study-hybrid-production.png").read_bytes()[:4] == b"\x89PNG"
    traces = sorted(out.glob("traces/*.jsonl"))
    assert [t.name for t in traces] == sorted(f"{m}-{mode}-8192.jsonl" for m in (
        "qwen3.5-27b", "gemma-3-27b") for mode in ("whole", "chunk", "layer"))
    assert all(check_file(t).ok for t in traces)
    assert "6 traces checked, all legal" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--models", "nope"], ["--prompts", "0"],
                                   ["--hw", "h200,nope"], ["--requests", "0"],
                                   ["--prompts", "300000"]])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, extra):
    """An unknown model or device, a prompt below 1 or past the context, no requests: one
    line naming it, exit 2, no folder."""
    assert main(["study-hybrid", "--out", str(tmp_path / "h"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "h").exists()
