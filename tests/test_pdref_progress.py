"""Properties of Coverage (layer bands) and LayerProgress, checked against sets of points."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdref.progress import Coverage, LayerProgress, ProgressError

T = 12


def rng(lo: int, hi: int):
    """Mostly a range with a <= b; sometimes a > b (empty)."""
    pair = st.tuples(st.integers(lo, hi), st.integers(lo, hi))
    return pair.map(lambda r: (min(r), max(r))) | pair


def region(r_layers, r_tokens) -> set[tuple[int, int]]:
    return {(lay, t) for lay in range(*r_layers) for t in range(*r_tokens)}


def points(cov: Coverage) -> set[tuple[int, int]]:
    out = set()
    for lay in range(cov.num_layers):
        for a, b in cov.tokens_of(lay):
            out |= {(lay, t) for t in range(a, b)}
    return out


def assert_bands_canonical(cov: Coverage) -> None:
    """Bands start at 0, increase, stay inside the layers, and neighbours differ."""
    assert cov.starts[0] == 0
    assert len(cov.starts) == len(cov.sets)
    assert all(a < b for a, b in zip(cov.starts, cov.starts[1:], strict=False))
    assert cov.starts[-1] < cov.num_layers
    assert all(x != y for x, y in zip(cov.sets, cov.sets[1:], strict=False))


@st.composite
def coverage_ops(draw):
    num_layers = draw(st.integers(1, 6))
    ops = draw(st.lists(st.tuples(st.booleans(), rng(0, num_layers), rng(0, T)), max_size=10))
    return num_layers, ops


def run_ops(num_layers, ops):
    cov, model = Coverage(num_layers), set()
    for add, layers, tokens in ops:
        if add:
            cov, model = cov.union(layers, tokens), model | region(layers, tokens)
        else:
            cov = cov.remove_tokens(tokens)
            model = {(lay, t) for lay, t in model if not tokens[0] <= t < tokens[1]}
    return cov, model


def first_run(cells: set[tuple[int, int]], want: set[tuple[int, int]], layers, tokens):
    """(layer, run) of the first point of the region that is in `cells`, in layer order."""
    for lay in range(*layers):
        for t in range(*tokens):
            if (lay, t) in cells:
                b = t
                while b < tokens[1] and (lay, b) in cells:
                    b += 1
                return lay, (t, b)
    return None


@given(coverage_ops())
def test_coverage_tracks_points(case):
    """union/remove_tokens hold exactly the model's points, with canonical bands."""
    cov, model = run_ops(*case)
    assert points(cov) == model
    assert_bands_canonical(cov)


@given(coverage_ops(), coverage_ops())
def test_coverage_equal_iff_same_points(c1, c2):
    """Coverages of the same layer count are equal values exactly when their points match."""
    cov1, m1 = run_ops(c1[0], c1[1])
    cov2, m2 = run_ops(c1[0], c2[1] if c2[0] == c1[0] else [])
    assert (cov1 == cov2) == (m1 == m2)


@given(coverage_ops(), st.data())
def test_coverage_queries(case, data):
    """first_overlap, first_gap and covers agree with the point model over any region."""
    num_layers, _ = case
    cov, model = run_ops(*case)
    layers = data.draw(rng(0, num_layers))
    tokens = data.draw(rng(0, T))
    cells = region(layers, tokens)
    assert cov.covers(layers, tokens) == (cells <= model)
    assert cov.first_overlap(layers, tokens) == first_run(model, cells, layers, tokens)
    missing = cells - model
    assert cov.first_gap(layers, tokens) == first_run(missing, cells, layers, tokens)


@st.composite
def partitions(draw, nonempty=False):
    """A guillotine partition of [0, L) x [prefix, prompt) into non-empty rectangles."""
    num_layers = draw(st.integers(1, 4))
    prompt = draw(st.integers(1, 30))
    prefix = draw(st.integers(0, prompt - 1 if nonempty else prompt))
    cuts = sorted(set(draw(st.lists(st.integers(prefix + 1, max(prefix + 1, prompt - 1)),
                                    max_size=4))) - {prompt})
    bounds = [prefix, *[c for c in cuts if prefix < c < prompt], prompt]
    rects = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        if a == b:
            continue
        lcuts = sorted(set(draw(st.lists(st.integers(1, num_layers), max_size=3))))
        lb = [0, *[c for c in lcuts if c < num_layers], num_layers]
        rects.extend(((la, lz), (a, b)) for la, lz in zip(lb, lb[1:], strict=False) if la < lz)
    return num_layers, prefix, prompt, draw(st.permutations(rects))


@given(partitions())
def test_any_partition_in_any_order_completes(case):
    """Landing every piece of a partition, in any order, completes and finishes the progress."""
    num_layers, prefix, prompt, rects = case
    p = LayerProgress(num_layers, prefix, prompt)
    landed = set()
    for i, (layers, tokens) in enumerate(rects):
        assert not p.is_complete()
        p = p.add(layers, tokens)
        landed |= region(layers, tokens)
        assert points(p.landed) == landed
        if i < len(rects) - 1:
            with pytest.raises(ProgressError):
                p.finish()
    assert p.is_complete() and p.missing() is None
    done = p.finish()
    assert done.finished
    with pytest.raises(ProgressError):
        done.add((0, num_layers), (prefix, prefix + 1) if prefix < prompt else (prefix, prefix))


@given(partitions(nonempty=True), st.data())
def test_overlapping_add_is_refused(case, data):
    """A span that shares a point with what already landed is refused, and nothing changes."""
    num_layers, prefix, prompt, rects = case
    k = data.draw(st.integers(1, len(rects)))
    p = LayerProgress(num_layers, prefix, prompt)
    for layers, tokens in rects[:k]:
        p = p.add(layers, tokens)
    landed = points(p.landed)
    lay, tok = data.draw(st.sampled_from(sorted(landed)))
    layers = (data.draw(st.integers(0, lay)), data.draw(st.integers(lay + 1, num_layers)))
    tokens = (data.draw(st.integers(prefix, tok)), data.draw(st.integers(tok + 1, prompt)))
    with pytest.raises(ProgressError):
        p.add(layers, tokens)


@given(st.integers(1, 4), st.integers(1, 20), st.data())
def test_add_checks_bounds(num_layers, prompt, data):
    """add accepts exactly the spans inside [0, L) x [prefix, prompt) (empty ones anywhere)."""
    prefix = data.draw(st.integers(0, prompt))
    layers = data.draw(rng(0, num_layers + 2))
    tokens = data.draw(rng(0, prompt + 2))
    inside_l = layers[1] <= layers[0] or (0 <= layers[0] and layers[1] <= num_layers)
    inside_t = tokens[1] <= tokens[0] or (prefix <= tokens[0] and tokens[1] <= prompt)
    p = LayerProgress(num_layers, prefix, prompt)
    if inside_l and inside_t:
        assert points(p.add(layers, tokens).landed) == region(layers, tokens)
    else:
        with pytest.raises(ProgressError):
            p.add(layers, tokens)


@given(coverage_ops(), st.integers(0, T), st.data())
def test_missing_is_first_gap_in_layer_order(case, prompt, data):
    """missing() names the first unlanded (layer, run) scanning layers then tokens."""
    num_layers, ops = case
    prefix = data.draw(st.integers(0, prompt))
    cov, model = run_ops(num_layers, ops)
    model = {(lay, t) for lay, t in model if prefix <= t < prompt}
    p = LayerProgress(num_layers, prefix, prompt)
    for lay in range(num_layers):
        for t in range(prefix, prompt):
            if (lay, t) in model:
                p = p.add((lay, lay + 1), (t, t + 1))
    need = region((0, num_layers), (prefix, prompt))
    assert p.missing() == first_run(need - model, need, (0, num_layers), (prefix, prompt))
    assert p.is_complete() == (need <= model)


def test_empty_suffix_is_complete_at_once():
    """A request with prefix == prompt needs nothing to land."""
    p = LayerProgress(3, 8, 8)
    assert p.is_complete()
    assert p.finish().finished
