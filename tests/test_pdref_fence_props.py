"""Properties of contract version 2 over random legal traces with cancellations and fences,
each checked against a plain-set model written from the contract's text."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from pdref import events as ev
from pdref.apply import apply, check_end, initial_state
from pdref.geometry import Geometry
from pdref.synth import SynthConfig, synth_trace
from pdref.violations import Violation

POOL = 48


def header(mode: str, max_pending: int) -> ev.Header:
    geo = Geometry(layers=3, kv_heads=1, head_dim=2, dtype_bytes=1, page_tokens=4)
    return ev.Header("props", mode, geo, POOL, max_pending)


traces = st.builds(
    lambda mode, pending, seed, fail, cancel: (
        header(mode, pending),
        synth_trace(header(mode, pending), SynthConfig(
            requests=12, max_live=3, max_prompt=60, chunk=16, fail_rate=fail,
            cancel_rate=cancel, producers=2, stages=False), seed)),
    st.sampled_from(["whole", "chunk", "layer"]), st.integers(1, 3), st.integers(0, 10**6),
    st.sampled_from([0.0, 0.1, 0.3]), st.sampled_from([0.05, 0.2, 0.5]),
)


class PlainModel:
    """Who may write which page: live slabs, and ended lives whose writers are unfenced."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[set, set]] = {}  # req -> (pages, spans not landed)
        self.ended: list[tuple[set, set]] = []  # (pages, spans not fenced) of aborted lives
        self.failed: set = set()

    def feed(self, e) -> None:
        kind = e.kind
        if kind == "reserve":
            self.live[e.req] = (set(e.pages), set())
        elif kind == "issue":
            self.live[e.req][1].add(e.span)
        elif kind == "land":
            self.live[e.req][1].discard(e.span)
        elif kind == "fail":
            self.failed.add(e.span)
        elif kind in ("release", "abort"):
            pages, writers = self.live.pop(e.req)
            self.ended.append((pages, writers))
        elif kind == "fence":
            for _, writers in [*self.ended, *self.live.values()]:
                writers.discard(e.span)

    def quarantined(self) -> set:
        return set().union(*(pages for pages, writers in self.ended if writers))

    def check_one_writer_per_page(self) -> None:
        held = self.quarantined()
        for pages, _ in self.live.values():
            assert not pages & held, "a live slab shares a page with an unfenced writer"


def pool_points(intervals) -> set:
    return {p for a, b in intervals for p in range(a, b)}


@settings(max_examples=40, deadline=None)
@given(traces)
def test_no_page_is_ever_writable_by_two_lives(case):
    """Safety: a live slab's pages and an unfenced span's pages never meet; pdref's pool
    quarantines exactly the pages the plain model says an unfenced writer may write."""
    head, events = case
    state, model = initial_state(head), PlainModel()
    for e in events:
        state = apply(state, e)
        model.feed(e)
        model.check_one_writer_per_page()
        assert pool_points(state.pool.quarantined) == model.quarantined()
        live = set().union(*(pages for pages, _ in model.live.values()))
        assert pool_points(state.pool.free) == set(range(POOL)) - live - model.quarantined()


def first_violation(head, events) -> str | None:
    state = initial_state(head)
    try:
        for e in events:
            state = apply(state, e)
        check_end(state)
    except Violation as v:
        return v.code
    return None


@settings(max_examples=40, deadline=None)
@given(traces, st.data())
def test_dropping_any_fence_makes_the_trace_illegal(case, data):
    """Without one of its fences a legal trace breaks COPY-5, COPY-2 or LIFE-1."""
    head, events = case
    fences = [i for i, e in enumerate(events) if e.kind == "fence"]
    if not fences:
        return
    drop = data.draw(st.sampled_from(fences))
    assert first_violation(head, events[:drop] + events[drop + 1:]) in (
        "COPY-5", "COPY-2", "LIFE-1")


def releasing_fences(head, events):
    """(index of a fence that frees quarantined pages, those pages, live ids before it)."""
    state = initial_state(head)
    for i, e in enumerate(events):
        before = state
        state = apply(state, e)
        if e.kind == "fence" and state.pool.quarantined_pages < before.pool.quarantined_pages:
            freed = pool_points(before.pool.quarantined) - pool_points(state.pool.quarantined)
            yield i, freed, set(before.requests.keys())


@settings(max_examples=40, deadline=None)
@given(traces)
def test_reserve_moved_before_the_releasing_fence_is_copy_5(case):
    """A reserve of once-quarantined pages, moved before the fence that freed them, is COPY-5."""
    head, events = case
    for i, freed, live in releasing_fences(head, events):
        later = [j for j in range(i + 1, len(events)) if events[j].kind == "reserve"
                 and freed & set(events[j].pages) and events[j].req not in live]
        if later:
            j = later[0]
            moved = attrs.evolve(events[j], t=events[i].t)
            mutant = events[:i] + [moved] + events[i:j] + events[j + 1:]
            assert first_violation(head, mutant) == "COPY-5"
            return
