"""The imperative helper both shells drive the protocol through."""

from __future__ import annotations

import pytest

from pdref import events as ev
from pdref.geometry import Geometry
from pdref.monitor import Monitor
from pdref.violations import Violation

GEO = Geometry(layers=2, kv_heads=1, head_dim=4, dtype_bytes=2, page_tokens=4)


def monitor(**kw) -> tuple[Monitor, list]:
    sunk: list = []
    header = ev.Header("test", ev.Mode.CHUNK, GEO, kw.get("pool", 4), kw.get("pending", 1))
    return Monitor(header, sunk.append), sunk


def test_refused_event_leaves_state_and_sink_untouched():
    """An illegal event raises its code; the state and the trace are as before it."""
    m, sunk = monitor()
    m.reserve(0.0, "a", 8, 0)
    before = m.state
    with pytest.raises(Violation) as err:
        m.emit(ev.Issue(0.1, "a", 0, (0, 2), (0, 8), 256))
    assert err.value.code == "COPY-1"
    assert m.state is before and len(sunk) == 1


def test_reserve_allocates_lowest_free_pages_and_reuses_returned_ones():
    """Pages come lowest first; an aborted slab's pages are handed out again."""
    m, _ = monitor()
    assert m.reserve(0.0, "a", 8, 0) == (0, 1)
    assert m.reserve(0.0, "b", 4, 0) == (2,)
    m.emit(ev.Abort(0.1, "a", "test"))
    assert m.free_pages == 3
    assert m.reserve(0.2, "c", 12, 0) == (0, 1, 3)


def test_queries_follow_the_state():
    """can_reserve, can_issue, pending and can_admit change as events land."""
    m, _ = monitor(pending=1)
    assert m.can_reserve(16, 0) and not m.can_reserve(17, 0)
    m.reserve(0.0, "a", 4, 0)
    m.emit(ev.Computed(0.1, "a", (0, 2), (0, 4)))
    m.emit(ev.Issue(0.1, "a", 0, (0, 2), (0, 4), 128))
    assert not m.can_issue() and m.pending() == 1 and not m.can_admit("a")
    m.emit(ev.Produced(0.2, "a", 9))
    assert not m.can_admit("a")
    m.emit(ev.Land(0.3, "a", 0))
    assert m.can_issue() and m.can_admit("a")


def test_time_going_back_is_refused_live():
    """The monitor refuses an event stamped before the previous one (TRACE-2)."""
    m, _ = monitor()
    m.reserve(1.0, "a", 4, 0)
    with pytest.raises(Violation) as err:
        m.emit(ev.Computed(0.5, "a", (0, 2), (0, 4)))
    assert err.value.code == "TRACE-2"


def test_close_reports_what_is_still_held():
    """close() is LIFE-1 while a request holds pages; fine once it is released."""
    m, _ = monitor()
    m.reserve(0.0, "a", 4, 0)
    with pytest.raises(Violation, match="LIFE-1"):
        m.close()
    m.emit(ev.Abort(0.1, "a", "done"))
    m.close()


def test_layer_mode_of_recurrent_model_refused_at_construction():
    """A Monitor for layer mode on a recurrent geometry cannot be made (CFG-1)."""
    recurrent = Geometry(layers=2, kv_heads=1, head_dim=4, dtype_bytes=2, recurrent=True)
    with pytest.raises(Violation, match="CFG-1"):
        Monitor(ev.Header("test", ev.Mode.LAYER, recurrent, 4, 1))


def test_stage_reported_after_it_ended_goes_to_the_stage_sink():
    """Monitor.stage takes a stage whose t precedes later protocol events; end < t is TRACE-2."""
    protocol, stages = [], []
    geo = Geometry(layers=1, kv_heads=1, head_dim=2, dtype_bytes=1, page_tokens=4)
    m = Monitor(ev.Header("t", "chunk", geo, 8, 1), protocol.append, stages.append)
    m.reserve(1.0, "r", 4, 0)
    m.stage(ev.Stage(0.5, "r", "compute", 0.9))
    assert [e.kind for e in protocol] == ["reserve"] and [e.name for e in stages] == ["compute"]
    with pytest.raises(Violation) as info:
        m.stage(ev.Stage(0.5, "r", "gather", 0.4))
    assert info.value.code == "TRACE-2" and len(stages) == 1


def test_recorded_stages_checked_for_form_and_order():
    """recorded_stages counts good stages; an end before its start, or a start before the
    previous one, is TRACE-2 naming the stage's times."""
    geo = Geometry(layers=1, kv_heads=1, head_dim=2, dtype_bytes=1, page_tokens=4)
    m = Monitor(ev.Header("t", "chunk", geo, 8, 1))
    m.recorded_stages("decode", [0.0, 1.0, 1.0, 2.5], [1.0, 1.0, 2.5, 3.0])
    assert m.events == 4
    with pytest.raises(Violation, match="ends at 1.5, before it starts at 2.0") as info:
        m.recorded_stages("decode", [0.0, 2.0, 3.0], [1.0, 1.5, 3.5])
    assert info.value.code == "TRACE-2"
    with pytest.raises(Violation, match="starts at 0.5, before the one recorded before it at 1.0"):
        m.recorded_stages("decode", [0.0, 1.0, 0.5], [0.5, 1.2, 0.7])
    with pytest.raises(ValueError):
        m.recorded_stages("decode", [0.0], [])
    assert m.events == 4


def test_recorded_relative_stages_checked_for_form():
    """recorded_relative_stages counts every stage of every group (a shared group once per
    use); a stage whose offsets end before they start is TRACE-2 at its absolute times."""
    geo = Geometry(layers=1, kv_heads=1, head_dim=2, dtype_bytes=1, page_tokens=4)
    m = Monitor(ev.Header("t", "chunk", geo, 8, 1))
    shared = (("gather", 0.0, 0.5), ("h2d", 0.5, 0.5))
    m.recorded_relative_stages([0.0, 2.0, 3.0], [shared, shared, (("gather", 0.0, 1.0),)])
    assert m.events == 5
    bad = (("gather", 0.0, 0.5), ("h2d", 0.75, 0.5))
    with pytest.raises(Violation, match="stage h2d ends at 4.5, before it starts at 4.75") as info:
        m.recorded_relative_stages([1.0, 4.0], [shared, bad])
    assert info.value.code == "TRACE-2" and m.events == 5
    with pytest.raises(ValueError):
        m.recorded_relative_stages([0.0], [])


def test_recorded_stage_rows_checked_for_form():
    """recorded_stage_rows counts rows in any order; a row that ends before it starts is
    TRACE-2 naming its stage, request and times."""
    geo = Geometry(layers=1, kv_heads=1, head_dim=2, dtype_bytes=1, page_tokens=4)
    m = Monitor(ev.Header("t", "chunk", geo, 8, 1))
    m.recorded_stage_rows([(2.0, "a", "compute", 3.0, None, "p0.compute"),
                           (0.0, "b", "compute", 0.0, None, "p0.compute")])
    assert m.events == 2
    with pytest.raises(Violation, match="stage gather of 'c' ends at 0.5, before it starts at 1.0"):
        m.recorded_stage_rows([(0.0, "a", "compute", 1.0, None, "p0.compute"),
                               (1.0, "c", "gather", 0.5, 3, "p0.gather")])
    assert m.events == 2
