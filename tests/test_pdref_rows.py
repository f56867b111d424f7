"""pdref.rows: the compact per-span events are checked and folded exactly as the events."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_helpers import header, mutate, run, traces

from pdref import events as ev
from pdref.fast_monitor import FastMonitor
from pdref.metrics import life_metrics
from pdref.monitor import Monitor
from pdref.rows import EVENT_OF_ROW, as_event, new_row
from pdref.violations import Violation

ROW_OF_EVENT = {event: row for row, event in EVENT_OF_ROW.items()}


def as_row(event):
    """The row of a per-span event (any other event as it is)."""
    row = ROW_OF_EVENT.get(type(event))
    if row is None:
        return event
    return new_row(row, attrs.astuple(event, recurse=False)[:len(row._fields)])


@pytest.mark.parametrize("row", list(EVENT_OF_ROW))
def test_a_row_has_its_events_fields_and_kind(row):
    """Field names, their order and the kind are the event's (an issue row's without v3's
    `state`: a row is a KV span; a computed row's without v4's `hit`: a row is computed,
    not a cache hit): a changed event breaks this."""
    event = EVENT_OF_ROW[row]
    assert row._fields == tuple(f.name for f in attrs.fields(event)
                                if f.name not in ("state", "hit"))
    assert row.kind == event.kind


def test_as_event_gives_the_event_and_keeps_events():
    """A row becomes the equal event; an event is returned as it is."""
    issue = ev.Issue(0.5, "a", 3, (0, 2), (0, 16), 64)
    assert as_event(as_row(issue)) == issue and type(as_event(as_row(issue))) is ev.Issue
    assert as_event(issue) is issue


@settings(max_examples=200, deadline=None)
@given(traces, st.data())
def test_rows_get_the_events_verdict(case, data):
    """Rows fed to either monitor stop at the same event, code and message as the events."""
    head, events = case
    if events:
        events = mutate(events, data)
    rows = [as_row(e) for e in events]
    verdict = run(Monitor(head), events)
    assert run(FastMonitor(head), rows) == verdict
    assert run(Monitor(head), rows) == verdict


def test_a_refused_row_names_the_event():
    """The Violation of a refused row carries the event itself, as the trace would show it."""
    fast = FastMonitor(header("chunk", 1, 2))
    fast.reserve(0.0, "a", 8, 0)
    issue = ev.Issue(0.1, "a", 0, (0, 3), (0, 4), 48)  # nothing computed yet
    with pytest.raises(Violation) as refused:
        fast.emit(as_row(issue))
    assert refused.value.code == "COPY-1" and refused.value.event == issue


@settings(max_examples=100, deadline=None)
@given(traces)
def test_metrics_fold_rows_as_events(case):
    """Every life's metrics and the staging peak are the same from rows as from events."""
    head, events = case
    fences = head.version >= 2
    assert life_metrics(map(as_row, events), fences) == life_metrics(events, fences)
