"""Simulator behaviour: modes, blocking, admission, pools, determinism, trace legality."""

import attrs
import pytest

from pdref.check import check_file
from pdref.geometry import Geometry
from pdref.metrics import run_metrics
from pdref.violations import Violation
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.copier import Copier
from pdsim.core.costs import Costs
from pdsim.core.metrics import single_metrics, workload_metrics
from pdsim.core.play import simulate
from pdsim.core.steps import plan_steps
from pdsim.views.report import write_trace

GEO = Geometry(layers=4, kv_heads=2, head_dim=8, dtype_bytes=2, page_tokens=4)
COSTS = Costs(token_s=1e-4, pair_s=1e-7, chunk_s=1e-3, span_s=2e-4, gather_byte_s=1e-10,
              link_stages=(("d2h", 1e-8), ("h2d", 1e-8)), link_latency_s=1e-5,
              contention=0.2, decode_token_s=1e-3)


def cfg(**kw) -> SimConfig:
    base = dict(geometry=GEO, costs=COSTS, mode="chunk", chunk=32, max_pending=2, pool_pages=256)
    base.update(kw)
    return SimConfig(**base)


def one(prompt=256, prefix=0) -> list[RequestSpec]:
    return [RequestSpec("r0", 0.0, prompt, prefix)]


def in_flight_peak(events) -> int:
    live, peak = 0, 0
    for e in events:
        live += {"issue": 1, "land": -1}.get(e.kind, 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_trace_of_each_mode_passes_pdref_check(tmp_path, mode):
    """A written trace of every mode is accepted by pdref's checker."""
    result = simulate(cfg(mode=mode), one(prompt=200, prefix=16))
    write_trace(tmp_path / "t.jsonl", result)
    verdict = check_file(tmp_path / "t.jsonl")
    assert verdict.ok, verdict.text()


def test_same_inputs_give_byte_identical_traces(tmp_path):
    """Two runs of the same workload write byte-identical traces."""
    for name in ("a", "b"):
        write_trace(tmp_path / name, simulate(cfg(), one()))
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_slow_link_blocks_the_producer_at_max_pending():
    """With a slow link the producer blocks, and never has more than max_pending in flight."""
    slow = cfg(costs=COSTS.scaled(bandwidth=0.001), max_pending=2)
    result = simulate(slow, one())
    fast = simulate(cfg(), one())
    assert in_flight_peak(result.events) == 2
    prefill = run_metrics(result.header, result.events)["prefill_s"]
    assert prefill > run_metrics(fast.header, fast.events)["prefill_s"] * 2


def test_whole_mode_tail_is_the_full_copy():
    """Whole mode's tail equals the copy time of its one span."""
    m = single_metrics(simulate(cfg(mode="whole"), one()))
    assert m["spans"] == 1
    assert m["tail_s"] == pytest.approx(m["copy_busy_s"], rel=1e-9)


def test_prefix_equal_prompt_needs_no_span():
    """A fully cached prompt issues no span and is admitted at produced."""
    result = simulate(cfg(), one(prompt=64, prefix=64))
    kinds = [e.kind for e in result.events]
    assert "issue" not in kinds and "admit" in kinds


def test_only_the_suffix_is_sent():
    """With a prefix, bytes cover exactly [prefix, prompt) on every layer."""
    m = single_metrics(simulate(cfg(), one(prompt=256, prefix=64)))
    assert m["bytes"] == GEO.region_bytes((0, 4), (64, 256))


def test_layer_mode_refused_for_recurrent_geometry():
    """Layer streaming is refused for a recurrent model, as CFG-1 says."""
    with pytest.raises(ValueError, match="CFG-1"):
        cfg(mode="layer", geometry=attrs.evolve(GEO, recurrent=True))


def test_recurrent_state_rides_on_the_last_span():
    """A recurrent model's state makes the last span (and the tail) longer in chunk mode."""
    plain = single_metrics(simulate(cfg(), one()))
    heavy = cfg(costs=attrs.evolve(COSTS, state_bytes=10**6))
    stateful = single_metrics(simulate(heavy, one()))
    assert stateful["bytes"] == plain["bytes"]
    assert stateful["tail_s"] > plain["tail_s"] + 0.005


def test_requests_wait_for_a_slab_in_a_small_pool():
    """When the pool holds one slab, each request reserves only after the previous release."""
    requests = [RequestSpec(f"r{i}", 0.0, 64) for i in range(3)]
    result = simulate(cfg(pool_pages=16, output_tokens=5), requests)
    order = [(e.kind, e.t) for e in result.events if e.kind in ("reserve", "release")]
    assert [k for k, _ in order] == ["reserve", "release"] * 3
    assert all(order[i][1] <= order[i + 1][1] for i in range(len(order) - 1))


def test_pool_too_small_for_a_request_is_refused():
    """A request no pool state could hold is refused up front, naming pool_pages."""
    with pytest.raises(ValueError, match="pool_pages"):
        simulate(cfg(pool_pages=2), one(prompt=64))


def test_two_producers_overlap_prefills():
    """Two producers finish two simultaneous requests sooner than one producer does."""
    requests = [RequestSpec(f"r{i}", 0.0, 256) for i in range(2)]
    one_p = workload_metrics(simulate(cfg(), requests))
    two_p = workload_metrics(simulate(cfg(producers=2), requests))
    assert two_p["makespan_s"] < one_p["makespan_s"] * 0.75


def test_contention_slows_compute_that_overlaps_gathers():
    """Raising the contention factor lengthens chunk-mode prefill."""
    slow_gather = attrs.evolve(COSTS, gather_byte_s=1e-7)
    calm = single_metrics(simulate(cfg(costs=attrs.evolve(slow_gather, contention=0.0)), one()))
    busy = single_metrics(simulate(cfg(costs=attrs.evolve(slow_gather, contention=1.0)), one()))
    assert busy["prefill_s"] > calm["prefill_s"]


def test_steps_memo_keeps_each_requests_own_spans():
    """Steps shared through a run's memo are the steps planned afresh: a whole-mode chunk
    that ended one request's prefill (its step carries the whole span) carries none in a
    longer request, and the longer request's last step carries its own whole span."""
    config, memo = cfg(mode="whole"), {}
    shorter, longer = RequestSpec("a", 0.0, 64, 0), RequestSpec("b", 0.0, 96, 0)
    first = plan_steps(config, shorter, memo)
    shared = plan_steps(config, longer, memo)
    assert first == plan_steps(config, shorter)
    assert shared == plan_steps(config, longer)
    assert [len(s.spans) for s in shared] == [0, 0, 1]
    assert shared[-1].spans[0].tokens == (0, 96) and first[-1].spans[0].tokens == (0, 64)


def test_a_copy_stage_ending_before_it_starts_is_refused(monkeypatch):
    """The run's end checks every span's copy stages through pdref: a copier whose last
    stage ends before it starts makes the run raise TRACE-2 instead of a trace."""
    plan = Copier._plan

    def backwards(self, nbytes):
        offsets, copy_s, contended = plan(self, nbytes)
        name, start, end = offsets[-1]
        return (*offsets[:-1], (name, end + 1e-3, end)), copy_s, contended

    monkeypatch.setattr(Copier, "_plan", backwards)
    with pytest.raises(Violation, match="stage h2d ends at") as info:
        simulate(cfg(), one())
    assert info.value.code == "TRACE-2"
