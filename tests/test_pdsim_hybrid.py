"""pdsim on hybrid models (contract v3): the Qwen3.5 and Gemma 3 presets in every mode and in
serving write legal version 3 traces, with state spans and window-only handoffs, and
their prices follow each layer's kind."""

from __future__ import annotations

import json

import pytest

from pdref.check import check_file
from pdref.models import load_model
from pdref.trace import read_trace
from pdsim.cli import main
from pdsim.core.costs import costs_for
from pdsim.core.engines import load_engine
from pdsim.core.profiles import load_hw, load_link

HYBRIDS = ("qwen3.5-27b", "gemma-3-27b")


def _run(tmp_path, capsys, model, *args):
    trace = tmp_path / f"{model}.jsonl"
    assert main(["run", "--json", "--model", model, "--trace", str(trace), *args]) == 0
    out = json.loads(capsys.readouterr().out)
    result = check_file(trace)
    assert result.ok, result.text()
    return out, [item for _, item in read_trace(trace)]


@pytest.mark.parametrize("model", HYBRIDS)
@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_every_mode_writes_a_legal_v3_trace(model, mode, tmp_path, capsys):
    """One request in each mode: a version 3 trace that pdref check passes; a linear
    model's states cross in state spans, a sliding model's handoff is smaller than its KV
    over every layer would be."""
    out, items = _run(tmp_path, capsys, model, "--mode", mode, "--prompt", "4096",
                      "--chunk", "512")
    header, events = items[0], items[1:]
    geo = header.geometry
    assert header.version == 3 and geo.kinds is not None
    states = [e for e in events if e.kind == "issue" and e.state]
    assert bool(states) == geo.recurrent
    assert sum(e.bytes for e in states) == geo.state_bytes((0, geo.layers))
    assert out["bytes"] < geo.region_bytes((0, geo.layers), (0, 4096)) + sum(
        e.bytes for e in states)


def test_layer_mode_ships_a_linear_layers_state_before_the_prefill_ends(tmp_path, capsys):
    """Layer streaming of Qwen3.5: the first state span is issued before `produced` (later
    layers still compute), unlike whole mode."""
    _, items = _run(tmp_path, capsys, "qwen3.5-27b", "--mode", "layer", "--prompt", "4096")
    events = items[1:]
    first_state = next(e.t for e in events if e.kind == "issue" and e.state)
    produced = next(e.t for e in events if e.kind == "produced")
    assert first_state < produced


@pytest.mark.parametrize("model", HYBRIDS)
def test_serving_run_is_legal(model, tmp_path, capsys):
    """A served workload with two producers: every request ok, the trace legal."""
    out, _ = _run(tmp_path, capsys, model, "--mode", "chunk", "--requests", "12",
                  "--rate", "2", "--prompt-range", "512:6000", "--output-tokens", "8",
                  "--producers", "2")
    assert out["requests"] == 12 and out["ok"] == 12


def test_sliding_layers_cost_less_than_full_ones_at_long_prompts():
    """Gemma 3's prefill of a long chunk costs less than the same model with every layer
    full (windowed attention), and its decode rows read windows, not whole contexts."""
    import attrs

    spec = load_model("gemma-3-27b")
    dense = attrs.evolve(spec, extra=tuple((k, v) for k, v in spec.extra
                                           if k not in ("layer_types", "sliding_window")))
    args = (load_hw("h200"), load_link("rdma-400g"), load_engine("production"))
    hybrid, full = costs_for(spec, *args), costs_for(dense, *args)
    assert hybrid.compute_s((28672, 32768)) < full.compute_s((28672, 32768))
    assert hybrid.decode_kv_token_s < full.decode_kv_token_s


def test_explain_and_sweep_run_on_a_hybrid(tmp_path, capsys):
    """`pdsim explain` and a small `pdsim sweep` (layer mode included) run on Qwen3.5."""
    assert main(["explain", "--model", "qwen3.5-27b", "--mode", "layer", "--prompt", "2048"]) == 0
    assert "critical path" in capsys.readouterr().out
    rows = tmp_path / "rows.json"
    assert main(["sweep", "--model", "qwen3.5-27b", "--modes", "chunk,layer", "--prompts",
                 "2048", "--chunks", "512", "--jobs", "1", "--json", str(rows)]) == 0
    assert {r["mode"] for r in json.loads(rows.read_text())["rows"]} == {"chunk", "layer"}
