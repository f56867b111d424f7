"""Compact forms of the three events a run makes for every span: `computed`, `issue`, `land`.

A simulator makes hundreds of thousands of them, and an attrs event (a frozen class: one
`object.__setattr__` per field) costs four times a tuple to build. A row is a NamedTuple
with the event's fields, in the event's order and under its names, and its `kind`: the
monitors check it as the event itself (`FastMonitor`'s transitions read fields by name;
`Monitor` and `apply` are handed `as_event(row)`) and `pdref.metrics` folds it alike. Rows
never reach a trace: `as_event` gives the event wherever one is written or compared.
Build one with `new_row(IssueRow, (t, req, ...))` (`tuple.__new__`: no Python call).
"""

from __future__ import annotations

from typing import NamedTuple

from pdref import events as ev
from pdref.events import SpanId
from pdref.intervals import Range

new_row = tuple.__new__


class ComputedRow(NamedTuple):
    t: float
    req: str
    layers: Range
    tokens: Range
    kind = "computed"


class IssueRow(NamedTuple):
    t: float
    req: str
    span: SpanId
    layers: Range
    tokens: Range
    bytes: int
    kind = "issue"


class LandRow(NamedTuple):
    t: float
    req: str
    span: SpanId
    kind = "land"


EVENT_OF_ROW: dict[type, type] = {ComputedRow: ev.Computed, IssueRow: ev.Issue,
                                  LandRow: ev.Land}


def as_event(event):
    """The event a row stands for (an event as it is)."""
    cls = EVENT_OF_ROW.get(type(event))
    return event if cls is None else cls(*event)
