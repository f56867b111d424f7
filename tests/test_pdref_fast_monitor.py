"""FastMonitor against Monitor on whole traces: random legal traces (faults, fences, prefixes,
stages, versions 1 and 2) and the same traces with one event dropped, duplicated, moved or
changed. (tests/test_pdref_machine.py compares them event by event on random events.)"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdref import events as ev
from pdref.fast_monitor import FastMonitor
from pdref.geometry import Geometry
from pdref.monitor import Monitor
from pdref.synth import SynthConfig, synth_trace
from pdref.violations import Violation


def header(mode: str, max_pending: int, version: int) -> ev.Header:
    geo = Geometry(layers=3, kv_heads=1, head_dim=2, dtype_bytes=1, page_tokens=4)
    return ev.Header("fast", mode, geo, 40, max_pending, version=version)


traces = st.builds(
    lambda mode, pending, version, seed, fail, cancel: (
        header(mode, pending, version),
        synth_trace(header(mode, pending, version), SynthConfig(
            requests=10, max_live=3, max_prompt=50, chunk=12, fail_rate=fail,
            cancel_rate=cancel if version == 2 else 0.0, producers=2), seed)),
    st.sampled_from(["whole", "chunk", "layer"]), st.integers(1, 3), st.sampled_from([1, 2]),
    st.integers(0, 10**6), st.sampled_from([0.0, 0.1, 0.3]), st.sampled_from([0.0, 0.2, 0.5]),
)


def run(monitor, events) -> tuple[int, str, str] | None:
    """(index, code, message) of the first event `monitor` refuses (or LIFE-1 at the end as
    index len(events)); None when the trace is legal."""
    for i, event in enumerate(events):
        try:
            monitor.emit(event)
        except Violation as v:
            return i, v.code, v.message
    try:
        monitor.close()
    except Violation as v:
        return len(events), v.code, v.message
    return None


@settings(max_examples=150, deadline=None)
@given(traces)
def test_legal_traces_leave_the_same_state(case):
    """A legal trace is legal to both, and the mirror ends as the specification's state."""
    head, events = case
    slow, fast = Monitor(head), FastMonitor(head)
    assert run(slow, events) is None and run(fast, events) is None
    assert fast.mirror.snapshot() == slow.state
    assert fast.deferred_legal == 0 and fast.events == slow.events


def mutate(events: list, data) -> list:
    """The trace with one event dropped, duplicated, moved earlier or with its time changed."""
    i = data.draw(st.integers(0, len(events) - 1), "at")
    how = data.draw(st.sampled_from(["drop", "duplicate", "earlier", "time"]), "how")
    out = list(events)
    if how == "drop":
        del out[i]
    elif how == "duplicate":
        out.insert(i, events[i])
    elif how == "earlier":
        j = data.draw(st.integers(0, i), "to")
        out.insert(j, out.pop(i))
    else:
        out[i] = attrs.evolve(events[i], t=events[i].t - data.draw(st.floats(0.0, 1.0)))
    return out


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
