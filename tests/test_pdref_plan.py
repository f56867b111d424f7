"""The span plan of each mode, shared by the simulator and the engine."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdref.events import Mode
from pdref.geometry import Geometry
from pdref.plan import PlanError, plan_chunks, plan_spans, plan_steps, validate_workload

GEO = Geometry(layers=3, kv_heads=1, head_dim=4, dtype_bytes=2, page_tokens=4)


def cells(regions):
    return [(la, t) for r in regions for la in range(*r.layers) for t in range(*r.tokens)]


@given(st.integers(1, 300), st.integers(0, 75), st.integers(1, 400),
       st.sampled_from(list(Mode)))
def test_plan_partitions_the_suffix_exactly_once(prompt, prefix_pages, chunk, mode):
    """Every mode's spans cover each (layer, token) of the suffix exactly once."""
    prefix = min(prefix_pages * GEO.page_tokens, prompt - prompt % GEO.page_tokens)
    planned = cells(plan_spans(mode, GEO, prompt, prefix, chunk))
    want = [(la, t) for la in range(GEO.layers) for t in range(prefix, prompt)]
    assert len(planned) == len(set(planned))
    assert sorted(planned) == sorted(want)


@given(st.integers(1, 300), st.integers(0, 300), st.integers(1, 400))
def test_chunks_are_ordered_contiguous_and_bounded(prompt, prefix, chunk):
    """Chunks start at the prefix, follow each other, and none is longer than `chunk`."""
    prefix = min(prefix, prompt)
    chunks = plan_chunks(prompt, prefix, chunk)
    ends = [prefix] + [b for _, b in chunks]
    assert [a for a, _ in chunks] == ends[:-1]
    assert ends[-1] == prompt
    assert all(0 < b - a <= chunk for a, b in chunks)


def test_empty_suffix_has_no_spans():
    """A prompt the decoder already holds entirely needs no span in any mode."""
    assert all(plan_spans(mode, GEO, 8, 8, 4) == [] for mode in Mode)


def test_layer_plan_is_one_span_per_layer_in_order():
    """Layer mode sends layer 0 first, then 1, ..., each over the whole suffix."""
    spans = plan_spans(Mode.LAYER, GEO, 10, 4, 3)
    assert [s.layers for s in spans] == [(0, 1), (1, 2), (2, 3)]
    assert {s.tokens for s in spans} == {(4, 10)}


def test_layer_plan_refused_for_recurrent_models():
    """Layer streaming of a recurrent geometry is refused, as CFG-1 says."""
    recurrent = Geometry(layers=2, kv_heads=1, head_dim=4, dtype_bytes=2, recurrent=True)
    with pytest.raises(PlanError, match="recurrent"):
        plan_spans(Mode.LAYER, recurrent, 10, 0, 4)


@pytest.mark.parametrize("prompt,prefix,chunk,field", [
    (0, 0, 4, "prompt"), (8, 0, 0, "chunk"), (8, 12, 4, "prefix"), (8, 3, 4, "page_tokens"),
])
def test_validate_workload_names_the_field(prompt, prefix, chunk, field):
    """A bad workload is refused with a message naming the broken field."""
    with pytest.raises(PlanError, match=field):
        validate_workload(prompt, prefix, chunk, page_tokens=4)


def _suffix_cells(prompt, prefix):
    return {(la, t) for la in range(GEO.layers) for t in range(prefix, prompt)}


@given(st.integers(1, 200), st.integers(0, 50), st.integers(1, 300),
       st.sampled_from(list(Mode)), st.booleans())
def test_steps_compute_the_suffix_once_and_ready_each_span_after_its_region(
        prompt, prefix_pages, chunk, mode, compute):
    """Steps compute every suffix cell once; each span of the plan is made ready once, in plan
    order, by the first step after which its whole region is computed."""
    prefix = min(prefix_pages * GEO.page_tokens, prompt - prompt % GEO.page_tokens)
    steps = plan_steps(mode, GEO, prompt, prefix, chunk, compute=compute)
    computed = cells(steps)
    assert len(computed) == len(set(computed))
    assert set(computed) == _suffix_cells(prompt, prefix)
    done, ready = set(), []
    for step in steps:
        done |= set(cells([step]))
        for span in step.spans:
            assert set(cells([span])) <= done
        ready += list(step.spans)
    assert ready == plan_spans(mode, GEO, prompt, prefix, chunk)


def test_chunk_steps_make_their_own_span_ready_and_whole_waits_for_the_last():
    """chunk: span k after step k; whole: nothing until the last chunk, then the one span."""
    chunk_steps = plan_steps(Mode.CHUNK, GEO, 10, 0, 4)
    assert [(s.tokens, [r.tokens for r in s.spans]) for s in chunk_steps] == [
        ((0, 4), [(0, 4)]), ((4, 8), [(4, 8)]), ((8, 10), [(8, 10)])]
    whole_steps = plan_steps(Mode.WHOLE, GEO, 10, 0, 4)
    assert [len(s.spans) for s in whole_steps] == [0, 0, 1]
    assert whole_steps[-1].spans[0].tokens == (0, 10)


def test_layer_steps_are_layer_major_over_the_suffix():
    """layer: step l computes layer l over the whole suffix and readies layer l's span."""
    steps = plan_steps(Mode.LAYER, GEO, 10, 4, 3)
    assert [(s.layers, s.tokens) for s in steps] == [((0, 1), (4, 10)), ((1, 2), (4, 10)),
                                                     ((2, 3), (4, 10))]
    assert all(s.spans[0].layers == s.layers for s in steps)


def test_export_only_is_one_step_readying_every_span():
    """compute=False: one step over the whole suffix, every span of the mode ready after it."""
    steps = plan_steps(Mode.CHUNK, GEO, 10, 4, 2, compute=False)
    assert len(steps) == 1 and steps[0].tokens == (4, 10) and steps[0].layers == (0, 3)
    assert len(steps[0].spans) == 3


def test_empty_suffix_has_no_steps():
    """A prompt the decoder already holds needs no compute step in any mode."""
    assert all(plan_steps(mode, GEO, 8, 8, 4) == [] for mode in Mode)
