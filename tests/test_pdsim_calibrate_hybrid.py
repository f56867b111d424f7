"""`pdsim calibrate` and `validate` on the engine's hybrid traces (contract v3)."""

from __future__ import annotations

import json

import pytest

from pdgpu.cli import write_trace
from pdgpu.engine import Engine
from pdgpu.handoff import handoff_geometry
from pdgpu.model import build_model
from pdgpu.workload import EngineConfig, Request
from pdref.models import load_model
from pdref.trace import read_trace
from pdsim.cli import main
from pdsim.fit.calibrate import calibrate
from pdsim.fit.engine_runs import EnginePoint
from pdsim.fit.predict import predict

HYBRIDS = ("tiny-qwen3.5", "tiny-gemma3")


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrid_preset_is_one_geometry_for_both_shells(name):
    """The preset's v3 geometry as pdsim reads it (layer_types, window, state bytes) is the
    one the engine's trace names for the model it builds from the same preset."""
    spec = load_model(name)
    assert spec.geometry(16) == handoff_geometry(spec, 16)
    model = build_model(spec, seed=0)
    if model.state_shape is not None:
        assert spec.geometry(16).state_bytes((0, spec.layers)) == model.state_shape.nbytes


def _engine_traces(tmp_path, name: str) -> list[str]:
    """One engine trace per mode of `name`: two requests (the first left out as warm-up)."""
    model, paths = build_model(load_model(name), seed=0), []
    tokens = tuple(range(1, 97))
    for mode in ("whole", "chunk", "layer"):
        config = EngineConfig(mode=mode, chunk=32, warmup=False)
        result = Engine(model, config).run([Request("r0", tokens), Request("r1", tokens, 16)])
        path = tmp_path / f"{mode}.jsonl"
        write_trace(result, path)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("name", HYBRIDS)
def test_calibrating_hybrid_engine_traces_gives_a_profile_that_predicts_their_bytes(
        tmp_path, name, capsys):
    """The engine's v3 traces of every mode calibrate (compute and copy terms fitted from
    their stages); the profile runs the same preset in pdsim, whose handoff moves exactly the
    bytes and spans the engine's trace does (window-cut K/V, state spans) in each mode."""
    paths = _engine_traces(tmp_path, name)
    cal = calibrate(paths)
    assert cal.compute.samples > 0 and cal.model == name
    profile = tmp_path / "cal.toml"
    assert main(["calibrate", *paths, "-o", str(profile)]) == 0
    capsys.readouterr()
    for mode, path in zip(("whole", "chunk", "layer"), paths, strict=True):
        issued = [e for _, e in read_trace(path) if e.kind == "issue" and e.req == "r1"]
        predicted = predict(load_model(name), str(profile), EnginePoint(96, 32, prefix=16), mode)
        assert predicted["bytes"] == sum(e.bytes for e in issued)
        assert predicted["spans"] == len(issued)
        assert predicted["handoff_s"] > 0


@pytest.mark.slow
def test_validate_predicts_held_out_hybrid_runs(tmp_path, capsys):
    """`pdsim validate --model tiny-qwen3.5 --grid quick`: every mode of every point runs
    on the engine with parity, no export-only runs (a hybrid's payload is not dense K/V),
    held-out errors finite, and the profile accepted by `pdsim run`."""
    code = main(["validate", "--model", "tiny-qwen3.5", "--grid", "quick", "--requests", "2",
                 "--out", str(tmp_path), "--json", "--quiet"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["configs"]) == 9 and out["export_configs"] == []
    assert all(c["parity"] for c in out["configs"])
    assert 0 <= out["median_handoff_err_pct"] < float("inf")
    assert main(["run", "--hw", str(tmp_path / "profile.toml"), "--model", "tiny-qwen3.5",
                 "--mode", "layer", "--prompt", "128", "--chunk", "32", "--json"]) == 0
