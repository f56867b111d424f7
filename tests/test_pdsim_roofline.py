"""Roofline op prices (pdsim/core/roofline.py) and the engine each output names."""

import json

import attrs
import pytest

from pdref.models import load_model
from pdsim.cli import main
from pdsim.core.costs import costs_for, engine_of
from pdsim.core.engines import load_engine
from pdsim.core.profiles import link_of, load_hw
from pdsim.core.roofline import MIXERS, Mixer, curve_at, layer_kinds

LLAMA = load_model("llama-3.1-8b")


def production(hw: str, spec=LLAMA):
    device = load_hw(hw)
    return costs_for(spec, device, link_of(device), load_engine("production"))


def test_curve_interpolates_in_log_and_is_flat_past_the_ends():
    """An efficiency table is read linearly in log x between points, flat outside them."""
    curve = ((256.0, 0.2), (1024.0, 0.6))
    assert curve_at(curve, 16) == 0.2 and curve_at(curve, 1e6) == 0.6
    assert curve_at(curve, 512) == pytest.approx(0.4)


@pytest.mark.parametrize("hw", ["a100-pcie", "h200"])
def test_decode_is_memory_bound_weights_once_per_step(hw):
    """A decode step reads the weights once: batch 16 costs under 1.2x batch 1 (the seed's
    linear model charged 2.8x), and batch 1 is within 5% of the step's overhead plus the
    weights at achievable HBM bandwidth."""
    c, device = production(hw), load_hw(hw)
    one, sixteen = c.decode_base_s(1), c.decode_base_s(16)
    assert sixteen < 1.2 * one
    weights = (LLAMA.params - LLAMA.vocab * LLAMA.hidden) * LLAMA.dtype_bytes
    engine = load_engine("production")
    floor = weights / (device.hbm_bandwidth * engine.arch[0][1].memory)
    assert one == pytest.approx(floor + engine.decode_step_s, rel=0.05)
    seed = costs_for(LLAMA, device, link_of(device), load_engine("seed-eager"))
    assert seed.decode_base_s(16) > 2 * seed.decode_base_s(1)


def test_decode_turns_compute_bound_past_the_ridge_point():
    """Far past the chip's ridge point (A100: ~160 FLOP/byte) a step grows with its rows:
    doubling 2048 rows nearly doubles the step; doubling 8 rows barely moves it."""
    c = production("a100-pcie")
    assert c.decode_base_s(16) / c.decode_base_s(8) < 1.05
    assert c.decode_base_s(4096) / c.decode_base_s(2048) > 1.8


def test_prefill_is_compute_bound_and_kv_read_is_linear():
    """8192 prompt tokens take at least their FLOPs at the best GEMM efficiency and peak; a
    decode step's KV read adds a fixed time per token."""
    c, device = production("h200"), load_hw("h200")
    flops = 2 * 8192 * (LLAMA.params - 2 * LLAMA.vocab * LLAMA.hidden)
    assert c.compute_s((0, 8192)) > flops / device.peak_flops / 0.81
    assert c.compute_s((0, 8192)) < 2 * flops / device.peak_flops / 0.81
    kv_token = 2 * LLAMA.kv_heads * LLAMA.head_dim * 2 * LLAMA.layers
    assert c.decode_kv_token_s == pytest.approx(kv_token / (device.hbm_bandwidth * 0.70))


def test_compute_scale_speeds_the_roofline_compute_side_only():
    """--compute-scale 2 halves a compute-bound prefill, leaves a memory-bound step alone."""
    c = production("a100-pcie")
    fast = c.scaled(compute=2.0)
    assert fast.compute_s((0, 8192)) < 0.55 * c.compute_s((0, 8192))
    assert fast.decode_base_s(1) == pytest.approx(c.decode_base_s(1), rel=0.01)


def test_each_layer_kind_is_priced_by_its_own_function(monkeypatch):
    """The hybrid's linear-attention layers are priced by the `recurrent` mixer (its state
    read per decode row); replacing that kind's function changes only its share."""
    hybrid = load_model("qwen3-next-80b-a3b")
    assert dict(layer_kinds(hybrid)) == {"attention": 12, "recurrent": 36}
    roofline = production("h200", hybrid).roofline
    row = MIXERS["recurrent"].decode_row(roofline)
    assert row > 0
    before, prefill = roofline.decode_base_s(4), roofline.prefill_s(0, 1024)
    monkeypatch.setitem(MIXERS, "recurrent", attrs.evolve(MIXERS["recurrent"],
                                                          decode_row=lambda r: row + 1e-3))
    assert roofline.decode_base_s(4) - before == pytest.approx(4 * 36 * 1e-3, rel=1e-6)
    assert roofline.prefill_s(0, 1024) == prefill
    assert isinstance(MIXERS["attention"], Mixer)


def test_every_output_names_its_engine(tmp_path, capsys):
    """`pdsim run` names the engine in its summary and the trace header (an added header
    field); the default is the production-class profile, a calibrated hw profile's own
    when it has one; an unknown engine is one line, exit 2."""
    trace = tmp_path / "t.jsonl"
    assert main(["run", "--json", "--prompt", "512", "--trace", str(trace)]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "production"
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["engine"] == "production" and header["hw"] == "a100-pcie"
    assert main(["run", "--json", "--prompt", "512", "--engine", "seed-eager"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "seed-eager"
    assert main(["run", "--prompt", "512", "--engine", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "engine" in err and "Traceback" not in err


def test_a_calibrated_profile_brings_its_own_engine(tmp_path):
    """A hw profile with software fields (what `pdsim calibrate` writes) is priced by them
    when no engine is named; a named engine wins."""
    path = tmp_path / "cal.toml"
    path.write_text('name = "cal"\nlink = "pcie-gen4"\npeak_flops = 1e12\n'
                    'hbm_bandwidth = 1e11\nefficiency = 0.5\nchunk_s = 0.25\n'
                    'gather_bandwidth = 1e10\nspan_s = 0.0\ncontention = 0.0\n')
    hw = load_hw(str(path))
    assert engine_of(hw).name == "cal" and engine_of(hw, "seed-eager").name == "seed-eager"
    assert costs_for(LLAMA, hw, link_of(hw), engine_of(hw)).chunk_s == 0.25
