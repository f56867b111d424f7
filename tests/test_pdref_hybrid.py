"""Contract version 3 (hybrid models): layer kinds, state spans and slots, sliding windows.
Every rule is checked by the specification (`apply`, `pdref check`) and the fast mirror
(`FastMonitor`) alike: legal hybrid lives of every mode, and each one broken in one place
gives the new rule's code from all three."""

from __future__ import annotations

import pytest
from hybrid_helpers import PAGE, hybrid_life, hybrid_traces, kv_bytes, state_issue
from hypothesis import given, settings
from hypothesis import strategies as st

from pdref import events as ev
from pdref.check import check_lines
from pdref.fast_monitor import FastMonitor
from pdref.geometry import Geometry
from pdref.kinds import LayerKind, window_range
from pdref.monitor import Monitor
from pdref.trace import dumps
from pdref.violations import Violation

GEO = Geometry(layers=3, kv_heads=1, head_dim=2, dtype_bytes=1, page_tokens=PAGE,
               recurrent=True, kinds=(LayerKind("linear", None, 10), LayerKind("sliding", 5),
                                      LayerKind("full")))


def verdicts(header, events, close=True):
    """(code, message) from Monitor, FastMonitor and the checker of the written trace; each
    None when it accepts. The two monitors must agree exactly."""
    found = []
    for cls in (Monitor, FastMonitor):
        monitor = cls(header)
        try:
            for event in events:
                monitor.emit(event)
            if close:
                monitor.close()
            found.append(None)
        except Violation as v:
            found.append((v.code, v.message))
    lines = [dumps(ev.header_to_json(header)).encode()]
    lines += [dumps(ev.event_to_json(e)).encode() for e in events]
    result = check_lines(lines, open_trace=not close)
    assert found[0] == found[1], found
    checked = None if result.ok else (result.code, result.message)
    assert checked == found[0], (checked, found[0])
    return None if found[0] is None else found[0][0]


def header(mode="chunk", geo=GEO, max_pending=2):
    return ev.Header("test", mode, geo, pool_pages=16, max_pending=max_pending)


def test_header_writes_version_3_and_reads_back():
    """A geometry with kinds makes a version 3 header whose JSON reads back equal."""
    from pdref.trace import parse_lines

    head = header()
    assert head.version == 3
    line = dumps(ev.header_to_json(head)).encode()
    assert next(parse_lines([line]))[1] == head


@pytest.mark.parametrize("change, words", [
    ({"kinds": [{"kind": "full"}]}, "array of 3"),
    ({"kinds": [{"kind": "full"}, {"kind": "sliding"}, {"kind": "full"}]}, "window"),
    ({"kinds": [{"kind": "linear", "state_bytes": 4}, {"kind": "full"}, {"kind": "x"}]}, "kind"),
    ({"kinds": [{"kind": "linear", "state_bytes": 4}] * 3, "recurrent": False}, "recurrent"),
    ({"kinds": [{"kind": "full", "window": 3}] * 3}, "takes no window"),
])
def test_malformed_kinds_are_trace1(change, words):
    """A kinds array of the wrong length, a kind without its parameter or with another's,
    an unknown kind, or `recurrent` disagreeing with the kinds: TRACE-1 at line 1."""
    obj = ev.header_to_json(header(geo=Geometry(3, 1, 2, 1, PAGE)))
    obj = {**obj, "version": 3, "geometry": {**obj["geometry"], **change}}
    result = check_lines([dumps(obj).encode()])
    assert (result.code, result.line) == ("TRACE-1", 1) and words in result.message


def test_kinds_are_ignored_before_version_3():
    """A v2 header's `kinds` is an extension: a v2 trace keeps its v2 verdict."""
    obj = {**ev.header_to_json(header(geo=Geometry(3, 1, 2, 1, PAGE))), "version": 2}
    obj["geometry"]["kinds"] = [{"kind": "linear", "state_bytes": 4}] * 3
    life = hybrid_life(Geometry(3, 1, 2, 1, PAGE, kinds=[LayerKind("full")] * 3), "chunk",
                       8, 0, 4)
    result = check_lines([dumps(obj).encode()] + [dumps(ev.event_to_json(e)).encode()
                                                  for e in life])
    assert result.ok, result.text()


def test_window_range_is_the_first_decode_steps_pages():
    """The window starts at the page of token prompt - window + 1, never below the prefix."""
    assert window_range(5, 8, 0, 4) == (4, 8)
    assert window_range(5, 9, 0, 4) == (4, 9)
    assert window_range(4, 9, 0, 4) == (4, 9)
    assert window_range(3, 9, 0, 4) == (4, 9)
    assert window_range(2, 9, 0, 4) == (8, 9)
    assert window_range(100, 9, 4, 4) == (4, 9)
    assert window_range(5, 8, 8, 4) == (8, 8)


@settings(max_examples=150, deadline=None)
@given(hybrid_traces())
def test_legal_hybrid_lives_are_legal_everywhere(case):
    """A life built from the contract's text, in any mode, kinds, prompt and prefix, is legal
    to the specification, the fast mirror and the checker."""
    head, events = case
    assert verdicts(head, events) is None


@settings(max_examples=100, deadline=None)
@given(hybrid_traces(linear=True))
def test_admission_without_a_state_is_state3(case):
    """Every state span dropped (with its land): admission is STATE-3."""
    head, events = case
    spans = {e.span for e in events if type(e) is ev.Issue and e.state}
    kept = [e for e in events if getattr(e, "span", None) not in spans]
    assert verdicts(head, kept) == "STATE-3"


@settings(max_examples=100, deadline=None)
@given(hybrid_traces(linear=True, min_prompt=2), st.data())
def test_state_before_the_last_token_is_state1(case, data):
    """The first state span issued with its layer one token short (its last `computed`
    stops early, and the rest comes after): STATE-1."""
    head, events = case
    first = next(i for i, e in enumerate(events) if type(e) is ev.Issue and e.state)
    layer = events[first].layers[0]
    prompt = events[0].prompt
    if data.draw(st.booleans(), "early position") or events[0].prefix == prompt:
        events[first] = ev.Issue(0.0, "a", events[first].span, events[first].layers,
                                 (prompt - 1, prompt - 1), events[first].bytes, True)
    else:
        events = [e for e in events if type(e) is not ev.Computed]
        events.insert(1, ev.Computed(0.0, "a", (0, head.geometry.layers), (0, prompt)))
        events.insert(1, ev.Computed(0.0, "a", (layer, layer + 1), (0, prompt - 1)))
        first = next(i for i, e in enumerate(events) if type(e) is ev.Issue and e.state)
        events = events[:2] + [events[first]] + events[2:first] + events[first + 1:]
    assert verdicts(head, events) == "STATE-1"


@settings(max_examples=100, deadline=None)
@given(hybrid_traces(linear=True), st.booleans())
def test_a_second_state_span_is_state2(case, landed):
    """A state span over a layer whose state landed (or is in flight): STATE-2."""
    head, events = case
    first = next(e for e in events if type(e) is ev.Issue and e.state)
    again = ev.Issue(0.0, "a", "again", first.layers, first.tokens, first.bytes, True)
    at = events.index(first) + 1 + landed  # before or after its land
    assert verdicts(head, events[:at] + [again] + events[at:]) in ("STATE-2", "COPY-2")
    wide = ev.Header("test", head.mode, head.geometry, head.pool_pages, 4)
    assert verdicts(wide, events[:at] + [again] + events[at:]) == "STATE-2"


@settings(max_examples=100, deadline=None)
@given(hybrid_traces(linear=True))
def test_writing_a_state_under_copy_is_state4(case):
    """A `computed` on a linear layer while its state span is in flight: STATE-4; after its
    state landed: STATE-4 too (the slot is no longer the life's)."""
    head, events = case
    first = next(e for e in events if type(e) is ev.Issue and e.state)
    at = events.index(first) + 1
    prompt = events[0].prompt
    write = ev.Computed(0.0, "a", first.layers, (prompt - 1, prompt))
    assert verdicts(head, events[:at] + [write] + events[at:]) == "STATE-4"
    assert verdicts(head, events[:at + 1] + [write] + events[at + 1:]) == "STATE-4"


@settings(max_examples=100, deadline=None)
@given(hybrid_traces(linear=True), st.booleans())
def test_a_reused_state_slot_is_state4(case, fenced):
    """A life aborted with its state span in flight: another life naming its slot is STATE-4
    until that span is fenced, and legal after."""
    head, events = case
    first = next(e for e in events if type(e) is ev.Issue and e.state)
    at = events.index(first) + 1
    cut = events[:at] + [ev.Abort(0.0, "a", "cancelled")]
    cut += [ev.Fence(0.0, "a", first.span)] if fenced else []
    pages = tuple(range(16, 16 + len(events[0].pages)))
    other = hybrid_life(head.geometry, "whole", events[0].prompt, events[0].prefix, 1, req="b",
                        first_span=100, pages=pages)
    assert verdicts(head, cut + other, close=fenced) == (None if fenced else "STATE-4")


def test_a_live_slot_is_held_until_every_state_landed():
    """A second life may name a live life's slot only once all its states landed."""
    a = hybrid_life(GEO, "whole", 8, 0, 1)
    b = hybrid_life(GEO, "whole", 8, 0, 1, req="b", first_span=10, pages=(2, 3))
    assert verdicts(header(), a[:4] + b[:1], close=False) == "STATE-4"
    assert verdicts(header(), a[:6] + b[:1], close=False) is None  # a's state landed
    assert verdicts(header(), a[:4] + [b[0].__class__(0.0, "b", 8, 0, (2, 3), "p1", 0)],
                    close=False) is None  # another producer's slot 0


@settings(max_examples=100, deadline=None)
@given(hybrid_traces(sliding=True, min_prompt=8))
def test_unclipped_sliding_bytes_are_slide1(case):
    """A KV span over a sliding layer that claims the bytes of its tokens outside the window
    (a writer that forgot the window) is SLIDE-1; any other wrong count is COPY-4."""
    head, events = case
    life = events[0]
    layer = head.geometry.kinds.index(LayerKind("sliding", 3))
    layers, tokens = (layer, layer + 1), (life.prefix, life.prompt)
    unclipped = kv_bytes(head.geometry, layers, tokens, life.prompt, life.prefix, clip=False)
    clipped = kv_bytes(head.geometry, layers, tokens, life.prompt, life.prefix)
    assert clipped < unclipped
    for size, code in ((unclipped, "SLIDE-1"), (clipped + 1, "COPY-4"), (clipped, None)):
        bad = ev.Issue(0.0, "a", "bad", layers, tokens, size)
        computed = ev.Computed(0.0, "a", (0, head.geometry.layers), (0, life.prompt))
        assert verdicts(header(geo=head.geometry), [life, computed, bad], close=False) == code


def test_state_span_on_a_non_linear_layer_is_cov1():
    """A state span naming a full or sliding layer, or on a geometry without kinds: COV-1."""
    life = hybrid_life(GEO, "whole", 8, 0, 1)[:4]
    bad = ev.Issue(0.0, "a", 9, (0, 2), (8, 8), 10, True)
    assert verdicts(header(), life + [bad], close=False) == "COV-1"
    dense = Geometry(2, 1, 2, 1, PAGE)
    plain = [ev.Reserve(0.0, "a", 8, 0, (0, 1)), ev.Computed(0.0, "a", (0, 2), (0, 8)),
             ev.Issue(0.0, "a", 0, (0, 1), (8, 8), 0, True)]
    assert verdicts(ev.Header("t", "chunk", dense, 8, 2, version=3), plain,
                    close=False) == "COV-1"


def test_state_bytes_and_slot_rules():
    """A state span claims its layers' state bytes (COPY-4); a geometry with linear layers
    needs a reserve's state slot (STATE-4); one without ignores none."""
    life = hybrid_life(GEO, "whole", 8, 0, 1)
    bad = state_issue(0.0, "a", 9, GEO, (0, 1), 8)
    bad = ev.Issue(0.0, "a", 9, (0, 1), (8, 8), bad.bytes + 1, True)
    assert verdicts(header(), life[:4] + [bad], close=False) == "COPY-4"
    no_slot = ev.Reserve(0.0, "a", 8, 0, (0, 1))
    assert verdicts(header(), [no_slot], close=False) == "STATE-4"


def test_layer_mode_is_legal_for_hybrids_and_cfg1_stays_for_unnamed_recurrence():
    """Layer streaming of a geometry with kinds is legal; a recurrent geometry without kinds
    keeps CFG-1 in every version."""
    life = hybrid_life(GEO, "layer", 8, 0, 1)
    assert verdicts(header("layer"), life) is None
    bare = Geometry(2, 1, 2, 1, PAGE, recurrent=True)
    for version in (2, 3):
        with pytest.raises(Violation) as info:
            Monitor(ev.Header("t", "layer", bare, 8, 1, version=version))
        assert info.value.code == "CFG-1"


def test_kinds_need_version_3():
    """A header built with kinds but an older version is refused (TRACE-1)."""
    with pytest.raises(Violation) as info:
        Monitor(ev.Header("t", "chunk", GEO, 8, 1, version=2))
    assert info.value.code == "TRACE-1"


def test_free_state_slot_follows_the_rules():
    """`free_state_slot` names the lowest slot a new life may take, on both monitors."""
    life = hybrid_life(GEO, "whole", 8, 0, 1)
    for cls in (Monitor, FastMonitor):
        m = cls(header())
        assert m.free_state_slot() == 0
        for e in life[:4]:
            m.emit(e)
        assert m.free_state_slot() == 1 and m.free_state_slot("p1") == 0
        for e in life[4:6]:
            m.emit(e)
        assert m.free_state_slot() == 0


@settings(max_examples=100, deadline=None)
@given(hybrid_traces(), st.sampled_from(["whole", "chunk", "layer"]), st.booleans())
def test_the_plan_of_every_mode_is_legal(case, mode, compute):
    """The shells' plan (plan_steps: compute steps and the spans each makes ready) of any
    hybrid geometry, mode, prompt, prefix and chunk, issued and landed in order, is a legal
    life to both monitors and the checker; every span's bytes from `Region.span_bytes`."""
    from pdref.plan import plan_steps

    head, events = case
    head = ev.Header("test", mode, head.geometry, head.pool_pages, 1)
    reserve, prompt, prefix = events[0], events[0].prompt, events[0].prefix
    life, span = [reserve], 0
    for step in plan_steps(mode, head.geometry, prompt, prefix, 5, compute):
        life.append(ev.Computed(0.0, "a", step.layers, step.tokens))
        for region in step.spans:
            life += [ev.Issue(0.0, "a", span, region.layers, region.tokens,
                              region.span_bytes(head.geometry, prompt, prefix), region.state),
                     ev.Land(0.0, "a", span)]
            span += 1
    life += [ev.Produced(0.0, "a", 1), ev.Admit(0.0, "a"), ev.Release(0.0, "a")]
    assert verdicts(head, life) is None


def test_a_profiles_layer_types_make_the_geometrys_kinds():
    """A model profile's Hugging Face layer_types become the geometry's kinds (every layer,
    version 3); an unknown type or a wrong count is refused naming the field."""
    from pdref.models import ProfileError, model_from_dict

    base = {"layers": 3, "hidden": 8, "heads": 2, "kv_heads": 1, "head_dim": 4,
            "intermediate": 8, "vocab": 16, "arch": "hybrid", "dtype": "bfloat16",
            "recurrent": True, "sliding_window": 5, "linear_state_bytes": 10,
            "layer_types": ["linear_attention", "sliding_attention", "full_attention"]}
    geo = model_from_dict(base, "m", "m.toml").geometry(page_tokens=PAGE)
    assert geo.kinds == GEO.kinds and geo.layers == 3
    assert ev.Header("t", "chunk", geo, 8, 1).version == 3
    for bad, words in ((["full_attention"] * 2, "must list 3"),
                       (["full_attention", "mamba", "full_attention"], "unknown type 'mamba'")):
        with pytest.raises(ProfileError, match=words):
            model_from_dict({**base, "layer_types": bad}, "m", "m.toml")
