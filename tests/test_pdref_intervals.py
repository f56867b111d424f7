"""Properties of IntervalSet and the range helpers, checked against plain Python sets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdref.intervals import IntervalSet, contains, intersect, is_empty, length, overlaps

N = 24
points = st.integers(0, N)
pairs = st.tuples(points, points)
ranges = pairs.map(lambda r: (min(r), max(r))) | pairs  # a > b allowed: an empty range
range_lists = st.lists(ranges, max_size=8)


def pts(r) -> set[int]:
    return set(range(r[0], r[1]))


def set_of(s: IntervalSet) -> set[int]:
    out: set[int] = set()
    for a, b in s:
        out |= set(range(a, b))
    return out


def build(rs) -> tuple[IntervalSet, set[int]]:
    s, model = IntervalSet(), set()
    for r in rs:
        s = s.union(r)
        model |= pts(r)
    return s, model


def assert_canonical(s: IntervalSet) -> None:
    """Sorted, non-empty, disjoint and non-adjacent ranges (so equal sets compare equal)."""
    assert len(s.starts) == len(s.ends) == len(s)
    for a, b in s:
        assert a < b
    for (_, b0), (a1, _) in zip(list(s), list(s)[1:], strict=False):
        assert b0 < a1


def runs(model: set[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for p in sorted(model):
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


@given(range_lists)
def test_union_matches_set_union(rs):
    """A chain of unions holds exactly the union of the points, in canonical form."""
    s, model = build(rs)
    assert set_of(s) == model
    assert_canonical(s)
    assert s.size == len(model)
    assert list(s) == runs(model)


@given(range_lists, range_lists)
def test_equal_sets_are_equal_values(rs1, rs2):
    """Two IntervalSets compare equal exactly when they hold the same points."""
    s1, m1 = build(rs1)
    s2, m2 = build(rs2)
    assert (s1 == s2) == (m1 == m2)
    assert s1 == IntervalSet.of(*runs(m1))


@given(range_lists, ranges)
def test_difference_matches_set_difference(rs, r):
    """difference removes exactly the points of r and keeps the canonical form."""
    s, model = build(rs)
    d = s.difference(r)
    assert set_of(d) == model - pts(r)
    assert_canonical(d)
    assert set_of(s) == model  # the original value is untouched


@given(range_lists, st.lists(st.tuples(st.booleans(), ranges), max_size=10))
def test_mixed_union_difference(rs, ops):
    """Any interleaving of unions and differences tracks the set model."""
    s, model = build(rs)
    for add, r in ops:
        if add:
            s, model = s.union(r), model | pts(r)
        else:
            s, model = s.difference(r), model - pts(r)
        assert set_of(s) == model
        assert_canonical(s)


@given(range_lists, ranges)
def test_covers(rs, r):
    """covers(r) is true exactly when every point of r is in the set."""
    s, model = build(rs)
    assert s.covers(r) == (pts(r) <= model)


@given(range_lists, st.data())
def test_queries_at_run_edges(rs, data):
    """Ranges that start or end next to a stored run's edges get exact answers."""
    s, model = build(rs)
    edges = sorted({e + d for a, b in s for e in (a, b) for d in (-1, 0, 1) if e + d >= 0} | {0})
    r = (data.draw(st.sampled_from(edges)), data.draw(st.sampled_from(edges)))
    assert s.covers(r) == (pts(r) <= model)
    assert (s.first_gap(r) is None) == (pts(r) <= model)
    assert (s.first_overlap(r) is None) == (not pts(r) & model)
    assert set_of(s.union(r)) == model | pts(r)
    assert set_of(s.difference(r)) == model - pts(r)


@given(range_lists, ranges)
def test_first_gap(rs, r):
    """first_gap is the maximal run of missing points starting at the lowest missing one."""
    s, model = build(rs)
    missing = pts(r) - model
    gap = s.first_gap(r)
    if not missing:
        assert gap is None
        return
    a = min(missing)
    b = a
    while b < r[1] and b not in model:
        b += 1
    assert gap == (a, b)


@given(range_lists, ranges)
def test_first_overlap(rs, r):
    """first_overlap is the maximal run of present points starting at the lowest shared one."""
    s, model = build(rs)
    shared = pts(r) & model
    hit = s.first_overlap(r)
    if not shared:
        assert hit is None
        return
    a = min(shared)
    b = a
    while b < r[1] and b in model:
        b += 1
    assert hit == (a, b)


@given(range_lists, st.data())
def test_take_lowest(rs, data):
    """take_lowest(n) removes and returns the n lowest points, in increasing order."""
    s, model = build(rs)
    n = data.draw(st.integers(0, len(model)))
    rest, taken = s.take_lowest(n)
    assert taken == tuple(sorted(model)[:n])
    assert set_of(rest) == model - set(taken)
    assert_canonical(rest)


@given(ranges, ranges)
def test_range_helpers(x, y):
    """length, is_empty, overlaps, contains and intersect agree with point sets."""
    px, py = pts(x), pts(y)
    assert length(x) == len(px)
    assert is_empty(x) == (not px)
    assert overlaps(x, y) == bool(px & py)
    assert contains(x, y) == (not py or (x[0] <= y[0] and y[1] <= x[1]))
    if py:
        assert contains(x, y) == (py <= px)
    assert pts(intersect(x, y)) == px & py
