"""Hybrid (contract v3) prices under both cost models: a linear layer and a sliding layer are
priced by their kind in prefill and decode, never as full attention over the context."""

from __future__ import annotations

import pytest

from pdref.models import load_model
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import costs_for, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.play import simulate
from pdsim.core.profiles import link_of, load_hw
from pdsim.core.twins import all_full

ENGINES = ("seed-eager", "production")
# (preset, its full-attention layers, its layers in all): from the presets' layer_types
HYBRIDS = (("gemma-3-27b", 10, 62), ("qwen3.5-27b", 16, 64))


def _costs(spec, engine: str, hw: str = "a100-pcie"):
    device = load_hw(hw)
    return costs_for(spec, device, link_of(device), load_engine(engine))


def _step_s(costs, context: int) -> float:
    """One decode step of a single request holding `context` tokens."""
    return costs.decode_step_s((context,))


def _growth(costs, a: int, b: int, chunk: int = 256) -> float:
    """How much more a prefill chunk costs at position b than at position a."""
    return costs.compute_s((b, b + chunk)) - costs.compute_s((a, a + chunk))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name, full, layers", HYBRIDS)
def test_a_decode_step_grows_with_the_context_on_full_layers_only(engine, name, full, layers):
    """A decode step's time per context token is the full layers' share of the all-full
    twin's: sliding layers read their window, linear layers their state, whatever the
    context (seed-eager priced every v3 layer as full)."""
    spec = load_model(name)
    hybrid, twin = _costs(spec, engine), _costs(all_full(spec), engine)
    slope = _step_s(hybrid, 32768) - _step_s(hybrid, 8192)
    twin_slope = _step_s(twin, 32768) - _step_s(twin, 8192)
    assert slope == pytest.approx(twin_slope * full / layers, rel=1e-9)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_sliding_decode_row_reads_its_window(engine):
    """At a context of exactly the window, Gemma 3's decode step reads the same KV as its
    all-full twin (every layer reads W tokens): the same time. Past the window the twin's
    sliding layers keep reading more, the hybrid's do not."""
    spec = load_model("gemma-3-27b")
    window = spec.get("sliding_window")
    hybrid, twin = _costs(spec, engine), _costs(all_full(spec), engine)
    assert _step_s(hybrid, window) == pytest.approx(_step_s(twin, window), rel=1e-9)
    twin_growth = _step_s(twin, 8 * window) - _step_s(twin, window)
    assert _step_s(twin, 8 * window) - _step_s(hybrid, 8 * window) == pytest.approx(
        twin_growth * 52 / 62, rel=1e-9)  # the 52 sliding layers' share of the growth


def _decode_steps_s(spec, engine: str, prompt: int, outputs: int) -> list[float]:
    """The decode steps' times of one simulated request of `prompt` tokens."""
    cfg = SimConfig(geometry=sim_geometry(spec), costs=_costs(spec, engine), mode="chunk",
                    chunk=256, output_tokens=outputs)
    record = simulate(cfg, [RequestSpec("r", 0.0, prompt, 0)]).decode
    return [b - a for a, b in zip(record.step_start, record.step_end, strict=True)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_decode_step_under_the_window_reads_the_context_not_the_window(engine):
    """A Gemma 3 request whose context stays under the window: each sliding layer holds and
    reads the whole context, as its all-full twin's layer does, so every decode step takes
    the twin's time (a whole window priced per row made them dearer); past the window the
    hybrid's steps are the cheaper."""
    spec = load_model("gemma-3-27b")
    short = _decode_steps_s(spec, engine, 300, 8)
    assert short == pytest.approx(_decode_steps_s(all_full(spec), engine, 300, 8), rel=1e-9)
    long = _decode_steps_s(spec, engine, 3000, 4)
    assert all(h < t for h, t in zip(long, _decode_steps_s(all_full(spec), engine, 3000, 4),
                                     strict=True))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_linear_decode_row_moves_its_state(engine):
    """A Qwen3.5 decode row reads and writes each linear layer's state: at a context of a
    few tokens (where the twin's KV read is negligible) it costs more than the twin's, by
    at least the states' bytes at HBM bandwidth."""
    spec = load_model("qwen3.5-27b")
    hybrid, twin = _costs(spec, engine), _costs(all_full(spec), engine)
    states = 48 * 2 * spec.get("linear_state_bytes")  # 48 linear layers, read + written
    hbm = load_hw("a100-pcie").hbm_bandwidth
    assert _step_s(hybrid, 1) - _step_s(twin, 1) >= 0.9 * states / hbm


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name, full, layers", HYBRIDS)
def test_prefill_attention_grows_on_full_layers_only(engine, name, full, layers):
    """A prefill chunk's cost grows with its position on the full layers only: past the
    window a sliding layer's attention is flat, a linear layer's always is; the growth is
    the full layers' share of the all-full twin's (seed-eager priced every layer's pairs)."""
    spec = load_model(name)
    hybrid, twin = _costs(spec, engine), _costs(all_full(spec), engine)
    grown, twin_grown = _growth(hybrid, 8192, 16384), _growth(twin, 8192, 16384)
    assert grown == pytest.approx(twin_grown * full / layers, rel=0.05)


def test_seed_eager_prices_windowed_pairs_below_the_window_like_full_ones():
    """A Gemma 3 chunk that ends inside the window attends every key before it on every
    layer: seed-eager prices it as the twin does; a chunk past the window less."""
    spec = load_model("gemma-3-27b")
    hybrid, twin = _costs(spec, "seed-eager"), _costs(all_full(spec), "seed-eager")
    assert hybrid.compute_s((0, 512)) == pytest.approx(twin.compute_s((0, 512)), rel=1e-9)
    assert hybrid.compute_s((4096, 4608)) < twin.compute_s((4096, 4608))

