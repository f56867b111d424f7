"""Compact forms of the three events a run makes for every span: `computed`, `issue`, `land`.

A simulator makes hundreds of thousands of them, and an attrs event (a frozen class: one
`object.__setattr__` per field) costs four times a tuple to build. A row is a namedtuple
with the event's fields, in the event's order and under its names, and its `kind`: the
monitors check it as the event itself (`FastMonitor`'s transitions read fields by name;
`Monitor` and `apply` are handed `as_event(row)`) and `pdref.metrics` folds it alike. Rows
never reach a trace: `as_event` gives the event wherever one is written or compared.
Build one with `new_row(IssueRow, (t, req, ...))` (`tuple.__new__`: no Python call).
"""

from __future__ import annotations

from collections import namedtuple

import attrs

from pdref import events as ev

new_row = tuple.__new__


def _row_of(event: type) -> type:
    """The row class of an event class: its fields (names, order) and its `kind`. An issue
    row stands for a KV span: it has no (v3) `state` field (a state span is an event); a
    computed row no (v4) `hit` (a cache hit is an event)."""
    names = [f.name for f in attrs.fields(event) if f.name not in ("state", "hit")]
    row = namedtuple(f"{event.__name__}Row", names, module=__name__)
    row.kind = event.kind
    return row


ComputedRow, IssueRow, LandRow = map(_row_of, (ev.Computed, ev.Issue, ev.Land))
IssueRow.state = False  # a row is a KV span (read only for an empty one: FastMonitor._issue)
ComputedRow.hit = None  # a row is computed, not a cache hit

EVENT_OF_ROW: dict[type, type] = {ComputedRow: ev.Computed, IssueRow: ev.Issue,
                                  LandRow: ev.Land}


def as_event(event):
    """The event a row stands for (an event as it is)."""
    cls = EVENT_OF_ROW.get(type(event))
    return event if cls is None else cls(*event)
