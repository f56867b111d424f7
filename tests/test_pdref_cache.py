"""Contract version 4 (the prefix cache): shared refcounted pages, the decoder's hit at reserve,
a producer's at computed, cache and evict. Every rule is checked by the specification
(`apply`, `pdref check`) and the fast mirror (`FastMonitor`) alike: legal traces built from the
contract's text (tests/cache_helpers.py) are legal to all three with the same state, and each
edited in one place gives the new rule's code from all three."""

from __future__ import annotations

import attrs
import pytest
from cache_helpers import PAGE, cache_traces, span_bytes
from hybrid_helpers import kv_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pdref_hybrid import verdicts
from vacuity_helpers import Vacuity

from pdref import events as ev
from pdref.check import check_lines
from pdref.fast_monitor import FastMonitor
from pdref.geometry import Geometry
from pdref.kinds import LayerKind
from pdref.monitor import Monitor
from pdref.trace import dumps
from pdref.violations import Violation

VACUOUS = Vacuity()
# Traces where the decoder's cache is hit (a shared prompt of two pages or more, a later wave)
# and where only the producer's is (the decoder caches nothing).
DECODER_HITS = cache_traces(decoder=True, min_shared=2 * PAGE, min_waves=2)
SOURCE_HITS = cache_traces(decoder=False, min_shared=PAGE, min_waves=2)
# ... and where cancelled lives leave unfenced spans reading the producer's cached pages
PINNING = cache_traces(decoder=False, min_shared=PAGE, min_waves=2, cancel_odds=2)


@pytest.fixture(scope="module", autouse=True)
def _few_vacuous_examples():
    """Each mutation property found its site in most examples."""
    yield
    VACUOUS.check()


def edit(sites, name: str, data):
    """One recorded site of mutation `name`, drawn; None (counted vacuous) when none."""
    found = sites.get(name, [])
    if not VACUOUS.tally(name, bool(found)):
        return None
    return data.draw(st.sampled_from(found), name)


@settings(max_examples=150, deadline=None)
@given(cache_traces())
def test_legal_cache_traces_are_legal_everywhere(case):
    """Waves of requests sharing a prompt, hitting both caches, cancelled and evicted, are
    legal to the specification, the fast mirror and the checker, and the mirror ends in the
    specification's state (shared pages and their counts included)."""
    head, events, _ = case
    assert verdicts(head, events) is None
    slow, fast = Monitor(head), FastMonitor(head)
    for event in events:
        slow.emit(event)
        fast.emit(event)
    assert fast.mirror.snapshot() == slow.state and fast.deferred_legal == 0


@settings(max_examples=100, deadline=None)
@given(DECODER_HITS, st.data())
def test_evicting_a_page_a_live_life_counts_is_evict1(case, data):
    """An evict of a decoder page a live request hit, anywhere in its life: EVICT-1 (its
    admission would count a page that is gone)."""
    head, events, sites = case
    site = edit(sites, "held_decoder", data)
    if site is None:
        return
    lo, hi, page = site
    at = data.draw(st.integers(lo, hi), "where")
    mutant = events[:at] + [ev.Evict(0.0, "x", (page,))] + events[at:]
    assert verdicts(head, _retimed(mutant)) == "EVICT-1"


@settings(max_examples=100, deadline=None)
@given(DECODER_HITS, st.data())
def test_a_hit_on_an_evicted_page_is_cache1(case, data):
    """A page nobody held is evicted just before a reserve that hits it: CACHE-1."""
    head, events, sites = case
    site = edit(sites, "hit_evicted", data)
    if site is None:
        return
    at, page = site
    mutant = events[:at] + [ev.Evict(0.0, "x", (page,))] + events[at:]
    assert verdicts(head, _retimed(mutant), close=False) == "CACHE-1"


@settings(max_examples=100, deadline=None)
@given(cache_traces(), st.data())
def test_a_hit_on_a_page_still_written_is_cache1(case, data):
    """A reserve hitting the first slab page of a live request before it was cached (its
    spans may still write it): CACHE-1."""
    head, events, sites = case
    site = edit(sites, "hit_uncached", data)
    if site is None:
        return
    at, page = site
    other = ev.Reserve(0.0, "zz", PAGE, PAGE, (), "p0", 99, (page,))
    assert verdicts(head, _retimed(events[:at] + [other] + events[at:]),
                    close=False) == "CACHE-1"


@settings(max_examples=100, deadline=None)
@given(DECODER_HITS, st.data())
def test_a_hit_out_of_order_is_cache1(case, data):
    """A hit naming its pages in another order (a page at the wrong position): CACHE-1."""
    head, events, sites = case
    at = edit(sites, "swap_hit", data)
    if at is None:
        return
    swapped = attrs.evolve(events[at], hit=events[at].hit[::-1])  # distinct pages: it differs
    events = events[:at] + [swapped] + events[at + 1:]
    assert verdicts(head, events, close=False) == "CACHE-1"


@settings(max_examples=100, deadline=None)
@given(DECODER_HITS, st.data())
def test_caching_before_the_last_land_is_cache2(case, data):
    """A decoder `cache` moved before the land of a span that writes its pages: CACHE-2."""
    head, events, sites = case
    site = edit(sites, "cache_early", data)
    if site is None:
        return
    at, land = site
    mutant = events[:land] + [events[at]] + events[land:at] + events[at + 1:]
    assert verdicts(head, _retimed(mutant), close=False) == "CACHE-2"


@settings(max_examples=100, deadline=None)
@given(DECODER_HITS, st.data())
def test_a_span_over_a_cached_page_is_cache2(case, data):
    """A span issued over a page its life put into the cache (it would write a shared
    page): CACHE-2."""
    head, events, sites = case
    site = edit(sites, "cached", data)
    if site is None:
        return
    at, life, (a, _) = site
    tokens, layers = (a, a + PAGE), (0, head.geometry.layers)
    size = span_bytes(head.geometry, layers, tokens, life.prompt, life.prefix)
    write = ev.Issue(0.0, life.req, "w", layers, tokens, size)
    assert verdicts(head, _retimed(events[:at + 1] + [write] + events[at + 1:]),
                    close=False) == "CACHE-2"


@settings(max_examples=100, deadline=None)
@given(SOURCE_HITS, st.data())
def test_evicting_a_source_page_under_copy_is_evict1(case, data):
    """A producer's cached page evicted while a live life copies from it: EVICT-1."""
    head, events, sites = case
    site = edit(sites, "sources_held", data)
    if site is not None:
        _assert_evict1(head, events, site[0] + 1, site[2][0])


@settings(max_examples=100, deadline=None)
@given(PINNING, st.data())
def test_evicting_a_source_page_an_unfenced_span_reads_is_evict1(case, data):
    """A producer's cached page evicted after its life was cancelled while its unfenced span
    still reads it: EVICT-1."""
    head, events, sites = case
    site = edit(sites, "pinned", data)
    if site is not None:
        _assert_evict1(head, events, *site)


def _assert_evict1(head, events, at: int, page) -> None:
    mutant = events[:at] + [ev.Evict(0.0, "x", (page,), "p0")] + events[at:]
    assert verdicts(head, _retimed(mutant), close=False) == "EVICT-1"


def _retimed(events):
    """The events with `t` made non-decreasing (an inserted or moved event keeps order)."""
    out, last = [], 0.0
    for e in events:
        last = max(last, e.t)
        out.append(e if e.t == last else attrs.evolve(e, t=last))
    return out


# --- focused cases ------------------------------------------------------------------------------

GEO = Geometry(2, 1, 2, 1, PAGE)


def head(geo=GEO, version=4):
    return ev.Header("t", "chunk", geo, pool_pages=8, max_pending=4, version=version)


def published_life(req="a", pages=(0, 1), geo=GEO, prompt=8, slot=None, t=0.0):
    """A life of `prompt` tokens that lands, is admitted and puts its whole pages into the
    decoder's cache (still live)."""
    L = geo.layers
    size = span_bytes(geo, (0, L), (0, prompt), prompt, 0)
    events = [ev.Reserve(t, req, prompt, 0, pages, "p0", slot, ()),
              ev.Computed(t, req, (0, L), (0, prompt)), ev.Issue(t, req, f"{req}0", (0, L),
                                                                (0, prompt), size)]
    if geo.recurrent:
        events.append(ev.Issue(t, req, f"{req}s", (0, 1), (prompt, prompt), 8, True))
        events.append(ev.Land(t, req, f"{req}s"))
    whole = prompt - prompt % PAGE
    return events + [ev.Land(t, req, f"{req}0"), ev.Produced(t, req, 1), ev.Admit(t, req),
                     ev.Cache(t, req, (0, whole), pages[:whole // PAGE])]


def test_cache_events_and_hits_need_version_4():
    """A cache or evict event, or a hit, in a version 3 run: TRACE-1 from both monitors (the
    events built by hand); the checker reads such a line as an unknown kind for the version."""
    life = published_life()
    for bad in (life, [ev.Evict(0.0, "x", (0,))],
                [ev.Reserve(0.0, "a", 8, 0, (0, 1), "p0", None, ())]):
        for cls in (Monitor, FastMonitor):
            monitor = cls(head(version=3))
            with pytest.raises(Violation) as info:
                for event in bad:
                    monitor.emit(event)
            assert info.value.code == "TRACE-1" and "version 4" in info.value.message
    obj = {**ev.header_to_json(head(version=3))}
    lines = [dumps(obj).encode(), dumps(ev.event_to_json(life[0])).encode(),
             dumps({"kind": "evict", "t": 0, "req": "x", "pages": [0]}).encode()]
    result = check_lines(lines)
    assert result.code == "TRACE-1" and "needs a version 4 trace" in result.message


def test_a_v3_trace_reads_the_hit_field_as_an_extension():
    """Before version 4 a reserve's `hit` is an unread extension: the verdict is v3's."""
    obj = ev.header_to_json(head(version=3))
    line = {"kind": "reserve", "t": 0, "req": "a", "prompt": 8, "prefix": 4, "pages": [0],
            "hit": [5]}
    result = check_lines([dumps(obj).encode(), dumps(line).encode()], open_trace=True)
    assert result.ok, result.text()


def test_a_page_shared_by_two_lives_is_evictable_only_after_both_end():
    """Pages hit by two live lives hold two references: evicting them is EVICT-1 until the
    last of both ends; then legal, and the pages are free for a slab again."""
    a = published_life()
    hit = [ev.Reserve(0.0, r, 12, 8, (p,), "p0", None, (0, 1)) for r, p in (("b", 2), ("c", 3))]
    ends = [ev.Release(0.0, "a"), ev.Abort(0.0, "b", "x"), ev.Abort(0.0, "c", "x")]
    evict = ev.Evict(0.0, "x", (0, 1))
    for cut in range(3):
        assert verdicts(head(), a + hit + ends[:cut] + [evict], close=False) == "EVICT-1"
    assert verdicts(head(), a + hit + ends + [evict]) is None
    again = ev.Reserve(0.0, "d", 8, 0, (0, 1), "p0", None, ())
    assert verdicts(head(), a + hit + ends + [evict, again], close=False) is None
    m = Monitor(head())
    for e in a + hit:
        m.emit(e)
    assert m.state.caches[""][0].refs == 3  # a published it, b and c hit it


def test_a_slab_never_takes_a_cached_page():
    """A reserve whose slab names a cached page (not evicted first): SLAB-1, saying so."""
    events = published_life() + [ev.Release(0.0, "a"), ev.Reserve(0.0, "b", 4, 0, (1,))]
    with pytest.raises(Violation) as info:
        monitor = Monitor(head())
        for e in events:
            monitor.emit(e)
    assert info.value.code == "SLAB-1" and "prefix cache" in info.value.message
    assert verdicts(head(), events, close=False) == "SLAB-1"


def test_a_hit_must_cover_the_prefix_and_a_producer_hit_whole_pages():
    """The hit names exactly the prefix's pages; a producer's hit every layer and whole
    pages: CACHE-1 otherwise."""
    a = published_life() + [ev.Release(0.0, "a")]
    short = ev.Reserve(0.0, "b", 12, 8, (2,), "p0", None, (0,))
    assert verdicts(head(), a + [short], close=False) == "CACHE-1"
    src = [ev.Reserve(0.0, "b", 8, 0, (2, 3)), ev.Computed(0.0, "b", (0, 2), (0, 8)),
           ev.Cache(0.0, "b", (0, 8), ("s0", "s1"), "p0"), ev.Reserve(0.0, "c", 8, 0, (4, 5))]
    for layers, tokens, hit in (((0, 1), (0, 4), ("s0",)), ((0, 2), (0, 6), ("s0", "s1")),
                                ((0, 2), (4, 8), ("s0",))):
        bad = ev.Computed(0.0, "c", layers, tokens, hit)
        assert verdicts(head(), src + [bad], close=False) == "CACHE-1", (layers, tokens, hit)
    good = ev.Computed(0.0, "c", (0, 2), (4, 8), ("s1",))
    assert verdicts(head(), src + [good], close=False) is None


def test_a_producer_cache_needs_computed_pages_and_new_ids():
    """A producer `cache` of tokens not computed on every layer, of another producer, or
    naming a page cached already: CACHE-2."""
    r = [ev.Reserve(0.0, "b", 8, 0, (2, 3)), ev.Computed(0.0, "b", (0, 1), (0, 8))]
    assert verdicts(head(), r + [ev.Cache(0.0, "b", (0, 4), ("s0",), "p0")],
                    close=False) == "CACHE-2"
    r.append(ev.Computed(0.0, "b", (0, 2), (0, 8)))
    assert verdicts(head(), r + [ev.Cache(0.0, "b", (0, 4), ("s0",), "p1")],
                    close=False) == "CACHE-2"
    twice = [ev.Cache(0.0, "b", (0, 4), ("s0",), "p0"), ev.Cache(0.0, "b", (4, 8), ("s0",), "p0")]
    assert verdicts(head(), r + twice, close=False) == "CACHE-2"
    assert verdicts(head(), r + twice[:1], close=False) is None


# --- hybrids: the contract v3 decision ------------------------------------------------------------

SLIDING = Geometry(2, 1, 2, 1, PAGE, kinds=(LayerKind("sliding", 5), LayerKind("full")))
HYBRID = Geometry(2, 1, 2, 1, PAGE, recurrent=True,
                  kinds=(LayerKind("linear", None, 8), LayerKind("full")))


def test_a_linear_layer_needs_no_cached_state_on_the_decoder():
    """Qwen3.5-like (linear + full): a decoder hit is legal; the state that crosses is the
    whole prompt's, computed (resumed from the producer's snapshot) over [prefix, prompt)."""
    a = published_life(geo=HYBRID, slot=0) + [ev.Release(0.0, "a")]
    b = [ev.Reserve(0.0, "b", 12, 8, (2,), "p0", 0, (0, 1)),
         ev.Computed(0.0, "b", (0, 2), (8, 12)),
         ev.Issue(0.0, "b", "b0", (0, 2), (8, 12), kv_bytes(HYBRID, (0, 2), (8, 12), 12, 8)),
         ev.Issue(0.0, "b", "bs", (0, 1), (12, 12), 8, True), ev.Land(0.0, "b", "b0"),
         ev.Land(0.0, "b", "bs"), ev.Produced(0.0, "b", 1), ev.Admit(0.0, "b"),
         ev.Release(0.0, "b")]
    assert verdicts(head(HYBRID), a + b) is None
    no_state = [e for e in b if getattr(e, "span", None) != "bs"]
    assert verdicts(head(HYBRID), a + no_state) == "STATE-3"


def test_a_page_below_a_sliding_window_serves_only_a_later_window():
    """Gemma-like (sliding window 5 + full): a slab page below its life's window holds no
    sliding KV; it is cached so, and a hit on it is legal only for a request whose window
    starts after it (CACHE-1 otherwise)."""
    a = published_life(geo=SLIDING)  # prompt 8: the window starts at 4, page 0 has no sliding KV
    a += [ev.Release(0.0, "a")]
    m = Monitor(head(SLIDING))
    for e in a:
        m.emit(e)
    assert [m.state.caches[""][p].sliding for p in (0, 1)] == [False, True]
    far = ev.Reserve(0.0, "b", 12, 4, (2, 3), "p0", None, (0,))  # window from 8: page 0 ok
    near = ev.Reserve(0.0, "b", 6, 4, (2,), "p0", None, (0,))  # window from 0: needs page 0
    assert verdicts(head(SLIDING), a + [far], close=False) is None
    assert verdicts(head(SLIDING), a + [near], close=False) == "CACHE-1"


def test_both_monitors_list_a_caches_pages_and_holders():
    """`cached` answers the same on both monitors: each page's first token and holders."""
    events = published_life() + [ev.Reserve(0.0, "b", 12, 8, (2,), "p0", None, (0, 1)),
                                 ev.Release(0.0, "a")]
    for cls in (Monitor, FastMonitor):
        m = cls(head())
        for e in events:
            m.emit(e)
        assert {p: (c.first, c.refs) for p, c in m.cached().items()} == {0: (0, 1), 1: (4, 1)}
        assert m.cached("p0") == {}
