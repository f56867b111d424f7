"""Metrics computed from a trace: one function for both shells."""

from __future__ import annotations

from pdref import events as ev
from pdref.geometry import Geometry
from pdref.metrics import life_metrics, run_metrics
from pdref.synth import SynthConfig, synth_trace

GEO = Geometry(layers=2, kv_heads=1, head_dim=4, dtype_bytes=2, page_tokens=4)
HEADER = ev.Header("test", ev.Mode.CHUNK, GEO, pool_pages=16, max_pending=2,
                   extra=(("chunk", 4),))
B = 16  # bytes of one token on one layer


def one_run(fail_first: bool = False) -> list:
    """A hand-made two-chunk run from 0.2: prefill ends at 0.5, the last span lands at 0.8."""
    out = []
    if fail_first:
        out += [ev.Reserve(0.0, "r", 8, 0, (0, 1)), ev.Computed(0.1, "r", (0, 2), (0, 8)),
                ev.Issue(0.1, "r", 90, (0, 2), (0, 8), 16 * B), ev.Fail(0.2, "r", 90, "x"),
                ev.Abort(0.2, "r", "retry")]
    out += [
        ev.Reserve(0.2, "r", 8, 0, (2, 3)),
        ev.Computed(0.3, "r", (0, 2), (0, 4)), ev.Issue(0.3, "r", 0, (0, 2), (0, 4), 8 * B),
        ev.Computed(0.5, "r", (0, 2), (4, 8)), ev.Issue(0.5, "r", 1, (0, 2), (4, 8), 8 * B),
        ev.Produced(0.5, "r", 42),
        ev.Land(0.6, "r", 0), ev.Land(0.8, "r", 1), ev.Admit(0.8, "r"), ev.Release(1.0, "r"),
    ]
    return out


def test_run_metrics_of_a_hand_made_run():
    """prefill, handoff, tail, bytes, spans and peak staging follow contract.md's definitions."""
    m = run_metrics(HEADER, one_run())  # times count from the request's reserve at 0.2
    assert abs(m["prefill_s"] - 0.3) < 1e-12 and abs(m["handoff_s"] - 0.6) < 1e-12
    assert abs(m["tail_s"] - 0.3) < 1e-12
    assert m["bytes"] == 16 * B and m["spans"] == 2
    assert m["peak_staging_bytes"] == 16 * B  # both spans in flight between 0.5 and 0.6
    assert m["first_token"] == 42 and m["chunk"] == 4 and m["mode"] == "chunk"


def test_run_metrics_count_a_retry_from_the_run_start():
    """After a failed life, the retried life is reported, timed from the first life's start."""
    m = run_metrics(HEADER, one_run(fail_first=True))
    assert m["lives"] == 2 and m["failed_spans"] == 1
    assert m["handoff_s"] == 0.8 and m["bytes"] == 16 * B and m["spans"] == 3


def test_simulator_runs_report_no_token():
    """report_token=False (the simulator) gives first_token None."""
    assert run_metrics(HEADER, one_run(), report_token=False)["first_token"] is None


def test_tail_is_zero_when_copies_finish_before_prefill():
    """A request whose spans all landed before produced has handoff = prefill."""
    events = [ev.Reserve(0.0, "r", 4, 0, (0,)), ev.Computed(0.1, "r", (0, 2), (0, 4)),
              ev.Issue(0.1, "r", 0, (0, 2), (0, 4), 8 * B), ev.Land(0.2, "r", 0),
              ev.Produced(0.4, "r", 1)]
    m = run_metrics(HEADER, events)
    assert m["handoff_s"] == m["prefill_s"] == 0.4 and m["tail_s"] == 0.0


def test_life_metrics_of_synthetic_traffic_are_consistent():
    """Every life of random traffic: ready >= produced >= start; bytes of landed spans only."""
    events = synth_trace(HEADER, SynthConfig(requests=20, max_prompt=40, chunk=4), seed=3)
    lives, peak = life_metrics(events)
    landed = {e.span for e in events if e.kind == "land"}
    issued = {e.span: e.bytes for e in events if e.kind == "issue"}
    assert sum(life.bytes for life in lives) == sum(issued[s] for s in landed)
    assert sum(life.spans for life in lives) == len(issued)
    assert peak <= 2 * max(issued.values(), default=0)
    for life in lives:
        if life.produced_t is not None:
            assert life.start <= life.produced_t <= life.ready_t


def test_back_to_back_requests_are_timed_from_their_own_start():
    """The reported request's times start at its own first event, not at the run start."""
    first = [ev.Reserve(0.0, "a", 4, 0, (0,)), ev.Computed(0.1, "a", (0, 2), (0, 4)),
             ev.Issue(0.1, "a", 10, (0, 2), (0, 4), 8 * B), ev.Land(0.2, "a", 10),
             ev.Produced(0.2, "a", 1), ev.Admit(0.2, "a"), ev.Release(0.3, "a")]
    second = [ev.Reserve(5.0, "b", 4, 0, (0,)), ev.Computed(5.5, "b", (0, 2), (0, 4)),
              ev.Issue(5.5, "b", 11, (0, 2), (0, 4), 8 * B), ev.Produced(5.5, "b", 2),
              ev.Land(5.75, "b", 11)]
    m = run_metrics(HEADER, first + second)
    assert m["prefill_s"] == 0.5 and m["handoff_s"] == 0.75 and m["tail_s"] == 0.25
    assert m["spans"] == 1 and m["lives"] == 1 and m["first_token"] == 2


def test_cancelled_span_holds_staging_until_its_fence_in_version_2():
    """v2: a cancelled span's bytes stay in peak staging until its fence; v1 frees at abort."""
    events = [ev.Reserve(0.0, "a", 8, 0, (0, 1)), ev.Computed(0.1, "a", (0, 2), (0, 8)),
              ev.Issue(0.1, "a", 0, (0, 2), (0, 8), 16 * B), ev.Abort(0.2, "a", "cancel"),
              ev.Reserve(0.3, "b", 8, 0, (2, 3)), ev.Computed(0.3, "b", (0, 2), (0, 8)),
              ev.Issue(0.3, "b", 1, (0, 2), (0, 8), 16 * B), ev.Fence(0.4, "a", 0),
              ev.Land(0.5, "b", 1)]
    assert life_metrics(events, fences=True)[1] == 32 * B
    assert life_metrics([e for e in events if e.kind != "fence"], fences=False)[1] == 16 * B
