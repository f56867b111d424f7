"""Hypothesis properties of the simulator (issue 3, 'Proof')."""

import io
import json

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdref.check import check_lines
from pdref.events import event_to_json, header_to_json
from pdref.geometry import Geometry
from pdref.models import MODELS_DIR, load_model
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import Costs, costs_for, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.metrics import single_metrics
from pdsim.core.play import simulate
from pdsim.core.profiles import load_hw, load_link

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def costs(draw) -> Costs:
    per_byte = st.floats(1e-11, 1e-7)
    stages = draw(st.lists(st.tuples(st.sampled_from(["d2h", "h2d", "net"]), per_byte),
                           min_size=1, max_size=2))
    return Costs(
        token_s=draw(st.floats(0, 1e-3)), pair_s=draw(st.floats(0, 1e-6)),
        chunk_s=draw(st.floats(0, 1e-2)), span_s=draw(st.floats(0, 1e-3)),
        gather_byte_s=draw(per_byte), link_stages=tuple(stages),
        link_latency_s=draw(st.floats(0, 1e-4)), streamed=draw(st.booleans()),
        copier=draw(st.sampled_from(["serial", "pipelined"])),
        fill_byte_s=draw(st.sampled_from([0.0, 1e-10])),
        contention=draw(st.floats(0, 1)), decode_token_s=draw(st.floats(0, 1e-3)),
        state_bytes=draw(st.sampled_from([0, 0, 4096])),
    )


@st.composite
def runs(draw, mode=None, requests=1):
    recurrent = draw(st.booleans())
    geo = Geometry(layers=draw(st.integers(1, 6)), kv_heads=draw(st.integers(1, 4)),
                   head_dim=draw(st.sampled_from([4, 8, 64])), dtype_bytes=2,
                   page_tokens=draw(st.sampled_from([1, 4, 16])), recurrent=recurrent)
    modes = ["whole", "chunk"] + ([] if recurrent else ["layer"])
    mode = mode or draw(st.sampled_from(modes))
    reqs = []
    for i in range(requests):
        prompt = draw(st.integers(1, 600))
        prefix = draw(st.integers(0, prompt // geo.page_tokens)) * geo.page_tokens
        arrival = draw(st.floats(0, 0.5)) if requests > 1 else 0.0
        reqs.append(RequestSpec(f"r{i}", arrival, prompt, prefix))
    reqs.sort(key=lambda r: r.arrival)
    need = max(geo.pages_for(r.prompt - r.prefix) for r in reqs)
    cfg = SimConfig(geo, draw(costs()), mode, draw(st.integers(1, 300)),
                    max_pending=draw(st.integers(1, 4)),
                    pool_pages=max(1, need * draw(st.integers(1, 3))),
                    producers=draw(st.integers(1, 2)), no_compute=draw(st.booleans()),
                    output_tokens=draw(st.integers(0, 8)))
    return cfg, reqs


def checked(result):
    """The run serialized as a trace and checked by pdref, as `pdref check` would."""
    lines = [json.dumps(header_to_json(result.header))]
    lines += [json.dumps(event_to_json(e)) for e in result.events]
    return check_lines(io.BytesIO(("\n".join(lines) + "\n").encode()))


@SETTINGS
@given(runs())
def test_every_single_run_trace_passes_check(run):
    """Every simulated single-request trace passes pdref check."""
    verdict = checked(simulate(*run))
    assert verdict.ok, verdict.text()


@SETTINGS
@given(st.integers(2, 6).flatmap(lambda n: runs(requests=n)))
def test_every_workload_trace_passes_check(run):
    """Every simulated multi-request workload trace passes pdref check."""
    verdict = checked(simulate(*run))
    assert verdict.ok, verdict.text()


@SETTINGS
@given(runs())
def test_handoff_never_below_lower_bound(run):
    """Handoff is never below the two-stage pipeline lower bound."""
    m = single_metrics(simulate(*run))
    assert m["handoff_s"] >= m["lower_bound_s"] * (1 - 1e-9) - 1e-12


@SETTINGS
@given(runs(), st.floats(1.0, 100.0))
def test_more_bandwidth_never_slower(run, factor):
    """Scaling every copy bandwidth up never makes handoff slower."""
    cfg, reqs = run
    base = single_metrics(simulate(cfg, reqs))["handoff_s"]
    faster = attrs.evolve(cfg, costs=cfg.costs.scaled(bandwidth=factor))
    assert single_metrics(simulate(faster, reqs))["handoff_s"] <= base * (1 + 1e-9) + 1e-12


@SETTINGS
@given(runs(mode="chunk"))
def test_chunk_peak_staging_within_max_pending_spans(run):
    """In chunk mode peak staging never exceeds max_pending spans of one chunk."""
    cfg, reqs = run
    m = single_metrics(simulate(cfg, reqs))
    span = cfg.geometry.region_bytes((0, cfg.geometry.layers), (0, cfg.chunk))
    assert m["peak_staging_bytes"] <= cfg.max_pending * span


@SETTINGS
@given(runs(mode="whole"))
def test_whole_tail_equals_full_copy_time(run):
    """Whole mode's tail equals its full copy time (nothing overlaps)."""
    m = single_metrics(simulate(*run))
    assert abs(m["tail_s"] - m["copy_busy_s"]) <= 1e-9 * max(1.0, m["handoff_s"])


@SETTINGS
@given(runs())
def test_pipelined_copier_never_slower_than_serial(run):
    """The same profile's pipelined copier hands off no later than its serial one, and
    exactly as fast when every request moves one span (nothing to overlap)."""
    cfg, reqs = run
    times = {kind: single_metrics(simulate(attrs.evolve(
        cfg, costs=attrs.evolve(cfg.costs, copier=kind)), reqs))
        for kind in ("serial", "pipelined")}
    serial, pipelined = times["serial"]["handoff_s"], times["pipelined"]["handoff_s"]
    assert pipelined <= serial * (1 + 1e-9) + 1e-12
    if times["serial"]["spans"] == 1:
        assert abs(pipelined - serial) <= 1e-9 * max(1.0, serial)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(p.stem for p in MODELS_DIR.glob("*.toml"))),
       st.sampled_from(["a100-pcie", "h100-sxm", "h200"]),
       st.sampled_from(["pcie-gen4", "pcie-gen5", "rdma-200g", "rdma-400g"]),
       st.sampled_from(["whole", "chunk", "layer"]), st.integers(1, 3000), st.integers(1, 700),
       st.integers(1, 3))
def test_shipped_profiles_give_legal_traces(model, hw, link, mode, prompt, chunk, pending):
    """Every shipped model x hw x link profile simulates to a legal trace (or CFG-1 refusal)."""
    spec = load_model(model)
    hw_profile = load_hw(hw)
    geo = sim_geometry(spec)
    if mode == "layer" and geo.recurrent:
        return
    engine = load_engine(["seed-eager", "production"][prompt % 2])  # both cost models
    cfg = SimConfig(geo, costs_for(spec, hw_profile, load_link(link), engine), mode, chunk,
                    max_pending=pending, pool_pages=geo.pages_for(prompt))
    verdict = checked(simulate(cfg, [RequestSpec("r0", 0.0, prompt)]))
    assert verdict.ok, verdict.text()
