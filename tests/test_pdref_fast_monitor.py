"""FastMonitor against Monitor on whole traces: random legal traces (faults, fences, prefixes,
stages, versions 1 and 2) and the same traces with one event dropped, duplicated, moved or
changed. (tests/test_pdref_machine.py compares them event by event on random events.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_helpers import header, mutate, run, traces

from pdref import events as ev
from pdref.fast_monitor import FastMonitor
from pdref.monitor import Monitor
from pdref.violations import Violation


@settings(max_examples=150, deadline=None)
@given(traces)
def test_legal_traces_leave_the_same_state(case):
    """A legal trace is legal to both, and the mirror ends as the specification's state."""
    head, events = case
    slow, fast = Monitor(head), FastMonitor(head)
    assert run(slow, events) is None and run(fast, events) is None
    assert fast.mirror.snapshot() == slow.state
    assert fast.deferred_legal == 0 and fast.events == slow.events


@settings(max_examples=300, deadline=None)
@given(traces, st.data())
def test_mutated_traces_get_the_same_verdict(case, data):
    """Both monitors stop at the same event with the same code and message, or accept."""
    head, events = case
    if not events:
        return
    events = mutate(events, data)
    assert run(FastMonitor(head), events) == run(Monitor(head), events)


def test_a_refused_event_changes_nothing():
    """A refused event leaves the mirror as it was (the specification gave the verdict)."""
    head = header("chunk", 1, 2)
    fast = FastMonitor(head)
    pages = fast.reserve(0.0, "a", 8, 0)
    before = fast.state
    with pytest.raises(Violation) as refused:
        fast.emit(ev.Issue(0.1, "a", 0, (0, 3), (0, 4), 48))  # nothing computed yet
    assert refused.value.code == "COPY-1"
    assert fast.state == before and pages == (0, 1)


@settings(max_examples=150, deadline=None)
@given(traces, st.data())
def test_landing_answers_like_the_specification(case, data):
    """Before every land of a (possibly mutated) trace, `landing` answers the same on both
    monitors, and a Span exactly when that land is accepted (its time aside: TRACE-2 is
    the event's, not the state's)."""
    head, events = case
    events = mutate(events, data) if events else events
    slow, fast = Monitor(head), FastMonitor(head)
    for event in events:
        if type(event) is ev.Land:
            got = fast.landing(event.req, event.span)
            assert got == slow.landing(event.req, event.span)
            code = _verdict(slow, event)
            if code is not None:
                assert got is None or code == "TRACE-2"
                return
            assert got is not None and got.span == event.span
        elif _verdict(slow, event) is not None:
            return
        fast.emit(event)


def _verdict(monitor, event) -> str | None:
    """The code `monitor.emit(event)` refuses it with; None when accepted."""
    try:
        monitor.emit(event)
    except Violation as v:
        return v.code
    return None
