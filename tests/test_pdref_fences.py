"""Contract version 2: fences, unfenced spans, quarantined pages and COPY-5, rule by rule."""

from __future__ import annotations

import pytest
from test_pdref_apply import Req, free_ids, header, refused, run

from pdref import events as ev
from pdref.apply import apply, check_end, initial_state
from pdref.check import check_lines
from pdref.state import SystemState
from pdref.violations import Violation


def v2(**kw) -> SystemState:
    return initial_state(header(version=2, **kw))


def fence(r: Req, span) -> ev.Fence:
    return ev.Fence(0.0, r.req, span)


def produced_and_failed(s: SystemState, r: Req, span=0) -> SystemState:
    """r reserved, computed, one whole span issued and failed (unfenced)."""
    return run(s, r.reserve(), r.computed(), r.issue(span), r.fail(span))


def test_failed_span_keeps_its_slot_until_fenced():
    """COPY-2: an unfenced span still counts toward max_pending; its fence frees the slot."""
    r = Req("r")
    s = produced_and_failed(v2(max_pending=1), r)
    assert s.pending_of("p0") == 1 and not s.can_issue("p0")
    other = Req("o", first_page=10)
    s = run(s, other.reserve(), other.computed())
    assert refused(s, other.issue(1)) == "COPY-2"
    s = apply(s, fence(r, 0))
    assert s.pending_of("p0") == 0
    apply(s, other.issue(1))


def test_version_1_fail_frees_the_slot_at_once():
    """Version 1 keeps its meaning: a failed span's slot is free at once, no fence exists."""
    s = produced_and_failed(initial_state(header(max_pending=1)), Req("r"))
    assert s.pending_of("p0") == 0 and not s.unfenced


def test_reuse_under_an_unfenced_span_is_copy_3():
    """COPY-3: reuse may not touch tokens that an unfenced span of the life reads."""
    r = Req("r")
    s = produced_and_failed(v2(), r)
    assert refused(s, r.reuse((0, 1))) == "COPY-3"
    s = apply(s, fence(r, 0))
    apply(s, r.reuse((0, 1)))


def test_abort_with_spans_in_flight_quarantines_the_slab():
    """An abort that cancels a span keeps the pages out of the pool until the span's fence."""
    r = Req("r")
    s = run(v2(pool_pages=8), r.reserve(), r.computed(), r.issue(0), r.abort())
    assert set(r.pages).isdisjoint(free_ids(s))
    assert s.pool.quarantined_pages == len(r.pages) and s.pending_of("p0") == 1
    thief = Req("t", prompt=4)
    assert refused(s, thief.reserve(pages=(r.pages[0],))) == "COPY-5"
    s = apply(s, fence(r, 0))
    assert set(r.pages) <= free_ids(s) and s.pool.quarantined_pages == 0
    apply(s, thief.reserve(pages=(r.pages[0],)))


def test_abort_without_unfenced_spans_frees_at_once():
    """An abort whose failed span was fenced already returns its pages at the abort."""
    r = Req("r")
    s = run(v2(pool_pages=8), r.reserve(), r.computed(), r.issue(0), r.fail(0), fence(r, 0),
            r.abort())
    assert set(r.pages) <= free_ids(s) and not s.quarantine


def test_quarantine_waits_for_the_last_of_several_spans():
    """A slab with two unfenced spans is released at the second fence, not the first."""
    r = Req("r", layers=2)
    s = run(v2(layers=2), r.reserve(), r.computed(), r.issue(0, layers=(0, 1)),
            r.issue(1, layers=(1, 2)), r.fail(0), r.abort())
    s = apply(s, fence(r, 1))
    assert s.pool.quarantined_pages == len(r.pages)
    s = apply(s, fence(r, 0))
    assert s.pool.quarantined_pages == 0 and set(r.pages) <= free_ids(s)


@pytest.mark.parametrize("case", ["never-issued", "landed", "wrong-req", "twice"])
def test_fence_of_a_span_that_is_not_unfenced_is_req_1(case):
    """REQ-1: a fence names an unfenced span of that request id, once."""
    r = Req("r")
    if case == "landed":
        s = run(v2(), r.reserve(), r.computed(), r.issue(0), r.land(0))
        assert refused(s, fence(r, 0)) == "REQ-1"
        return
    s = produced_and_failed(v2(), r)
    if case == "never-issued":
        assert refused(s, fence(r, 7)) == "REQ-1"
    elif case == "wrong-req":
        assert refused(s, fence(Req("x"), 0)) == "REQ-1"
    else:
        s = apply(s, fence(r, 0))
        assert refused(s, fence(r, 0)) == "REQ-1"


def test_fence_of_an_ended_life_while_its_retry_lives():
    """A fence for an aborted life is legal while a retry of the same id holds other pages."""
    r = Req("r", prompt=4)
    s = run(v2(pool_pages=4), r.reserve(), r.computed(), r.issue(0), r.abort())
    retry = Req("r", prompt=4, first_page=1)
    s = run(s, retry.reserve(), fence(r, 0))
    assert s.live("r").pages == retry.pages and 0 in free_ids(s)
    assert s.unfenced_of("r") == ()


def test_failed_life_is_never_admitted_even_when_fenced():
    """ADM-1: a life with a failed span is not admitted, fenced or not."""
    r = Req("r")
    s = produced_and_failed(v2(), r)
    s = run(s, fence(r, 0), r.issue(1), r.land(1), r.produced())
    assert refused(s, r.admit()) == "ADM-1"


def test_trace_may_not_end_with_an_unfenced_span():
    """LIFE-1: at the end of a complete trace no span is unfenced."""
    r = Req("r")
    s = run(v2(), r.reserve(), r.computed(), r.issue(0), r.abort())
    with pytest.raises(Violation) as info:
        check_end(s)
    assert info.value.code == "LIFE-1"
    check_end(apply(s, fence(r, 0)))


def test_reserve_check_order_puts_copy_5_between_the_slab_checks():
    """reserve: page count, ids in range and duplicates (SLAB-1) before COPY-5, before held."""
    r = Req("r", prompt=4)
    live = Req("l", prompt=4, first_page=1)
    s = run(v2(pool_pages=4), r.reserve(), r.computed(), r.issue(0), r.abort(), live.reserve())
    thief = Req("t", prompt=8)
    assert refused(s, thief.reserve(pages=(0,))) == "SLAB-1"  # count
    assert refused(s, thief.reserve(pages=(0, 9))) == "SLAB-1"  # outside the pool
    assert refused(s, thief.reserve(pages=(0, 0))) == "SLAB-1"  # twice
    assert refused(s, thief.reserve(pages=(1, 0))) == "COPY-5"  # quarantined beats held
    assert refused(s, thief.reserve(pages=(1, 2))) == "SLAB-1"  # held by a live slab


def _lines(*objs) -> list[bytes]:
    import json
    return [json.dumps(o).encode() for o in objs]


HEADER = {"kind": "header", "version": 2, "source": "t", "mode": "whole", "pool_pages": 4,
          "max_pending": 1, "geometry": {"layers": 1, "kv_heads": 1, "head_dim": 1,
                                         "dtype_bytes": 1, "page_tokens": 4}}


@pytest.mark.parametrize("version, fence_obj, code, line", [
    (1, {"kind": "fence", "t": 0, "req": "r", "span": 0}, "TRACE-1", 2),
    (2, {"kind": "fence", "t": 0, "req": "r"}, "TRACE-1", 2),
    (2, {"kind": "fence", "t": 0, "req": "r", "span": [0]}, "TRACE-1", 2),
    (2, {"kind": "fence", "t": 0, "req": "r", "span": 1.5}, "TRACE-1", 2),
    (5, {"kind": "fence", "t": 0, "req": "r", "span": 0}, "TRACE-1", 1),
    (2, {"kind": "fence", "t": 0, "req": "r", "span": 0}, "REQ-1", 2),
    (3, {"kind": "fence", "t": 0, "req": "r", "span": 0}, "REQ-1", 2),
    (4, {"kind": "fence", "t": 0, "req": "r", "span": 0}, "REQ-1", 2),
])
def test_malformed_fences_and_versions(version, fence_obj, code, line):
    """A fence in a v1 trace or without a well-typed span is TRACE-1; version 5 is line 1;
    versions 3 and 4 keep version 2's fences."""
    result = check_lines(_lines({**HEADER, "version": version}, fence_obj))
    assert (result.code, result.line) == (code, line)
