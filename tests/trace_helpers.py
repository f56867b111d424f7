"""Shared by the pdref monitor tests: a small header, random legal traces of it, a trace
with one event mutated, and a monitor's verdict on a trace."""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from pdref import events as ev
from pdref.geometry import Geometry
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
