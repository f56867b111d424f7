"""pdsim's copier model: serial (one worker) and pipelined (a lane per stage)."""

import attrs
import pytest

from pdref.models import load_model
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.copier import Copier
from pdsim.core.costs import Costs, costs_for, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.play import simulate
from pdsim.core.profiles import link_of, load_hw

SPEC = load_model("qwen3-0.6b")
A100 = load_hw("a100-pcie")


def _costs(copier: str, streamed: bool = False) -> Costs:
    return Costs(token_s=1e-4, pair_s=0.0, chunk_s=1e-3, span_s=2e-4, gather_byte_s=1e-11,
                 link_stages=(("d2h", 1e-9), ("h2d", 1e-9)), link_latency_s=3e-5,
                 streamed=streamed, copier=copier)


def _stages(result, name: str) -> dict[int, tuple[float, float]]:
    return {e.span: (e.t, e.end) for e in result.events if e.kind == "stage" and e.name == name}


def _export(costs: Costs, mode: str = "chunk", max_pending: int = 2):
    cfg = SimConfig(sim_geometry(SPEC), costs, mode, 256, max_pending=max_pending,
                    pool_pages=4096, no_compute=True)
    return simulate(cfg, [RequestSpec("r0", 0.0, 4096)])


def test_pipelined_d2h_of_next_span_overlaps_h2d_of_the_one_before():
    """Pipelined: span k+1's d2h runs while span k's h2d does (the link's two directions)."""
    result = _export(_costs("pipelined"))
    d2h, h2d = _stages(result, "d2h"), _stages(result, "h2d")
    spans = sorted(d2h)
    assert len(spans) == 16
    for k, k1 in zip(spans, spans[1:], strict=False):
        assert d2h[k1][0] < h2d[k][1] and h2d[k][0] < d2h[k1][1], (k, k1)


def test_serial_copier_starts_a_span_only_after_the_one_before_landed():
    """Serial: a span's first stage starts no earlier than the previous span's land."""
    result = _export(_costs("serial"))
    lands = {e.span: e.t for e in result.events if e.kind == "land"}
    gathers = _stages(result, "gather")
    spans = sorted(gathers)
    assert all(gathers[b][0] >= lands[a] for a, b in zip(spans, spans[1:], strict=False))


@pytest.mark.parametrize("streamed", [False, True])
def test_one_span_alone_has_the_same_times_on_both_copiers(streamed):
    """A span with the copier to itself: identical stage times and land, serial or not."""
    serial = Copier(_costs("serial", streamed)).schedule(1.0, 10_000_000)
    pipelined = Copier(_costs("pipelined", streamed)).schedule(1.0, 10_000_000)
    assert serial.land == pytest.approx(pipelined.land)
    for a, b in zip(serial.stages, pipelined.stages, strict=True):
        assert a[0] == b[0] and a[1:] == pytest.approx(b[1:])


def test_pipelined_lanes_take_spans_in_issue_order():
    """Three spans issued together: each lane runs them one after another, in order."""
    copier = Copier(_costs("pipelined"))
    times = [copier.schedule(0.0, 1_000_000) for _ in range(3)]
    for name in ("gather", "d2h", "h2d"):
        runs = [t.stage(name) for t in times]
        assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:], strict=False)), name
    assert [t.land for t in times] == sorted(t.land for t in times)


def test_a_hung_writer_holds_its_lanes_until_it_stops():
    """Faults: a writer stopped after its planned land keeps every lane it used until then."""
    copier = Copier(_costs("pipelined"))
    first = copier.schedule(0.0, 1_000_000)
    copier.stopped(first, first.land + 5.0)
    second = copier.schedule(0.0, 1_000_000)
    assert second.stage("gather")[0] >= first.land + 5.0


def test_pipelined_chunked_export_beats_serial_on_the_a100_profile():
    """With no compute to hide behind, only the serial copier makes chunked export slower
    than whole export on the shipped a100-pcie profile (fitted to whole copies only)."""
    base = costs_for(SPEC, A100, link_of(A100), load_engine("seed-eager"))
    assert base.copier == "serial"

    def handoff(copier: str, mode: str) -> float:
        result = _export(attrs.evolve(base, copier=copier), mode)
        return max(e.t for e in result.events if e.kind == "land")

    whole = handoff("serial", "whole")
    assert handoff("pipelined", "whole") == pytest.approx(whole)
    assert handoff("serial", "chunk") > 1.05 * whole
    assert handoff("pipelined", "chunk") < whole
