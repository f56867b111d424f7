"""Properties of `apply` (the issue's Proof list) and one focused example per violation code,
under version 1's meaning (fail and abort free at once); version 2's fences:
tests/test_pdref_fences.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdref import events as ev
from pdref.apply import apply, check_end, initial_state
from pdref.geometry import Geometry
from pdref.state import SystemState
from pdref.violations import CODES, Violation

PT = 4  # page_tokens
BPT = 2 * 1 * 2 * 1  # bytes per token and layer: 2 * kv_heads * head_dim * dtype_bytes


def header(layers=3, pool_pages=64, max_pending=4, mode="chunk", recurrent=False, version=1):
    geo = Geometry(layers=layers, kv_heads=1, head_dim=2, dtype_bytes=1, page_tokens=PT,
                   recurrent=recurrent)
    return ev.Header("test", mode, geo, pool_pages, max_pending, version=version)


def nbytes(layers, tokens) -> int:
    return BPT * max(0, layers[1] - layers[0]) * max(0, tokens[1] - tokens[0])


def npages(prompt, prefix) -> int:
    return (prompt - prefix + PT - 1) // PT


def run(state: SystemState, *events) -> SystemState:
    for e in events:
        state = apply(state, e)
    return state


def refused(state: SystemState, event) -> str:
    """The code `apply` refuses `event` with (fails the test if it is accepted)."""
    with pytest.raises(Violation) as info:
        apply(state, event)
    assert info.value.code in CODES
    return info.value.code


def free_ids(state: SystemState) -> set[int]:
    return {p for a, b in state.pool.free for p in range(a, b)}


class Req:
    """Event builders for one request (t is irrelevant to apply)."""

    def __init__(self, req="r", prompt=12, prefix=0, layers=3, first_page=0, producer="p0"):
        self.req, self.prompt, self.prefix, self.layers = req, prompt, prefix, layers
        self.pages = tuple(range(first_page, first_page + npages(prompt, prefix)))
        self.producer = producer

    def reserve(self, pages=None, prompt=None, prefix=None):
        return ev.Reserve(0.0, self.req, self.prompt if prompt is None else prompt,
                          self.prefix if prefix is None else prefix,
                          self.pages if pages is None else pages, self.producer)

    def computed(self, layers=None, tokens=None):
        return ev.Computed(0.0, self.req, layers or (0, self.layers),
                           tokens or (0, self.prompt))

    def issue(self, span, layers=None, tokens=None, size=None):
        layers = layers or (0, self.layers)
        tokens = tokens or (self.prefix, self.prompt)
        return ev.Issue(0.0, self.req, span, layers, tokens,
                        nbytes(layers, tokens) if size is None else size)

    def land(self, span):
        return ev.Land(0.0, self.req, span)

    def fail(self, span):
        return ev.Fail(0.0, self.req, span, "boom")

    def reuse(self, tokens):
        return ev.Reuse(0.0, self.req, tokens)

    def produced(self):
        return ev.Produced(0.0, self.req, 7)

    def admit(self):
        return ev.Admit(0.0, self.req)

    def release(self):
        return ev.Release(0.0, self.req)

    def abort(self):
        return ev.Abort(0.0, self.req, "test")


# --- strategies ----------------------------------------------------------------------------


@st.composite
def partitions(draw, nonempty=False):
    """(layers, prompt, prefix, rects): a partition of [0, L) x [prefix, prompt) into spans."""
    num_layers = draw(st.integers(1, 4))
    prompt = draw(st.integers(1, 40))
    top = (prompt - 1) // PT if nonempty else prompt // PT
    prefix = PT * draw(st.integers(0, top))
    cuts = draw(st.lists(st.integers(prefix, prompt), max_size=4))
    bounds = sorted({prefix, prompt, *cuts})
    rects = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        lcuts = draw(st.lists(st.integers(0, num_layers), max_size=3))
        lb = sorted({0, num_layers, *lcuts})
        rects.extend(((la, lz), (a, b)) for la, lz in zip(lb, lb[1:], strict=False))
    return num_layers, prompt, prefix, draw(st.permutations(rects))


def start(num_layers, prompt, prefix, max_pending=64, pool_pages=64):
    r = Req("r", prompt, prefix, num_layers)
    s = initial_state(header(num_layers, pool_pages, max_pending))
    return r, run(s, r.reserve(), r.computed())


# --- properties ----------------------------------------------------------------------------


@given(partitions(), st.integers(1, 3), st.data())
def test_partition_lands_and_admits_in_any_order(case, max_pending, data):
    """Any partition, issued and landed in any interleaving, completes; admit only at the end."""
    num_layers, prompt, prefix, rects = case
    r, s = start(num_layers, prompt, prefix, max_pending)
    s = apply(s, r.produced())
    todo, flying, span = list(rects), [], 0
    while todo or flying:
        if flying:
            assert refused(s, r.admit()) == "ADM-1"
        elif todo:
            assert refused(s, r.admit()) == "COV-3"
        can_issue = todo and s.can_issue("p0")
        assert s.pending_of("p0") == len(flying)
        if can_issue and (not flying or data.draw(st.booleans())):
            layers, tokens = todo.pop(0)
            s = apply(s, r.issue(span, layers, tokens))
            flying.append(span)
            span += 1
        else:
            s = apply(s, r.land(flying.pop(data.draw(st.integers(0, len(flying) - 1)))))
    assert s.can_admit("r")
    s = run(s, r.admit(), r.release())
    assert s.free_pages == 64 and not s.requests and s.pending_of("p0") == 0


@given(partitions(nonempty=True), st.data())
def test_overlapping_span_is_refused(case, data):
    """Overlapping landed tokens is COV-2 at land; overlapping a span in flight, at issue."""
    num_layers, prompt, prefix, rects = case
    r, s = start(num_layers, prompt, prefix)
    k = data.draw(st.integers(1, len(rects)))
    for i, (layers, tokens) in enumerate(rects[:k]):
        s = run(s, r.issue(i, layers, tokens), r.land(i))
    cells = sorted({(la, t) for layers, tokens in rects[:k]
                    for la in range(*layers) for t in range(*tokens)})
    lay, tok = data.draw(st.sampled_from(cells))

    def around():
        return ((data.draw(st.integers(0, lay)), data.draw(st.integers(lay + 1, num_layers))),
                (data.draw(st.integers(prefix, tok)), data.draw(st.integers(tok + 1, prompt))))

    layers, tokens = around()
    s2 = apply(s, r.issue(100, layers, tokens))  # issue only checks spans in flight
    assert refused(s2, r.land(100)) == "COV-2"
    # an issued span in flight: anything sharing a point with it is refused at issue
    s3 = apply(s, r.issue(200, *around()))
    span2 = r.issue(201, *around())
    assert refused(s3, span2) == "COV-2"


@st.composite
def reservations(draw):
    ops = []
    for i in range(draw(st.integers(1, 12))):
        prompt = draw(st.integers(1, 40))
        prefix = PT * draw(st.integers(0, prompt // PT))
        how = draw(st.sampled_from(["alloc", "random", "end"]))
        pages = tuple(draw(st.lists(st.integers(0, 21), max_size=npages(prompt, prefix) + 1)))
        ops.append((f"r{i % 5}", prompt, prefix, how, pages))
    return ops


@given(reservations())
def test_reservations_never_exceed_pool_and_never_collide(ops):
    """Reserve succeeds exactly when it names the right count of distinct free ids."""
    pool = 20
    s = initial_state(header(2, pool))
    held: dict[str, tuple[int, ...]] = {}
    for req, prompt, prefix, how, pages in ops:
        if how == "end":
            if req in held:
                s = apply(s, ev.Abort(0.0, req, "x"))
                del held[req]
            continue
        if how == "alloc" and s.can_reserve(prompt, prefix):
            pages = s.pool.allocate(s.pages_needed(prompt, prefix))[1]
        e = ev.Reserve(0.0, req, prompt, prefix, pages)
        taken = {p for ps in held.values() for p in ps}
        free = set(range(pool)) - taken
        if req in held:
            assert refused(s, e) == "REQ-1"
        elif len(pages) != npages(prompt, prefix) or len(set(pages)) != len(pages) \
                or not set(pages) <= free:
            assert refused(s, e) == "SLAB-1"
        else:
            s = apply(s, e)
            held[req] = pages
        all_held = [p for ps in held.values() for p in ps]
        assert len(all_held) == len(set(all_held)) <= pool
        assert free_ids(s) == set(range(pool)) - set(all_held)
        assert s.free_pages == pool - len(all_held)


@given(partitions(nonempty=True), st.data())
def test_admit_refused_after_a_failure(case, data):
    """Once a span failed, admit is ADM-1 even after the region is re-sent and lands."""
    num_layers, prompt, prefix, rects = case
    r, s = start(num_layers, prompt, prefix)
    bad = data.draw(st.integers(0, len(rects) - 1))
    for i, (layers, tokens) in enumerate(rects):
        s = apply(s, r.issue(i, layers, tokens))
        if i == bad:
            s = run(s, r.fail(i), r.issue(1000, layers, tokens))
            assert refused(s, r.admit()) == "ADM-1"
            s = apply(s, r.land(1000))
        else:
            s = apply(s, r.land(i))
    s = apply(s, r.produced())
    assert r.req in s.requests and s.live("r").progress.is_complete()
    assert not s.can_admit("r")
    assert refused(s, r.admit()) == "ADM-1"
    s = apply(s, r.abort())
    assert s.free_pages == 64


@given(partitions(nonempty=True), st.data())
def test_admit_refused_with_a_span_in_flight(case, data):
    """With every span landed but one extra (empty) span in flight, admit is ADM-1."""
    num_layers, prompt, prefix, rects = case
    r, s = start(num_layers, prompt, prefix)
    for i, (layers, tokens) in enumerate(rects):
        s = run(s, r.issue(i, layers, tokens), r.land(i))
    s = run(s, r.produced(), r.issue("e", (0, 0), (prefix, prefix), 0))
    assert refused(s, r.admit()) == "ADM-1"
    s = run(s, r.land("e"), r.admit())


@st.composite
def populations(draw):
    """Several requests in assorted phases: (prompt, prefix, spans in flight, phase)."""
    reqs = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.integers(1, 24))
        prefix = PT * draw(st.integers(0, prompt // PT))
        reqs.append((prompt, prefix, draw(st.integers(0, 2)),
                     draw(st.sampled_from(["reserved", "failed", "admitted"]))))
    return reqs, draw(st.permutations(range(len(reqs))))


@given(populations(), st.integers(0, 1))
def test_abort_and_release_return_every_page(case, producers):
    """Ending every life, by release or abort, in any order, frees every page and span."""
    reqs, order = case
    pool = 64
    s = initial_state(header(2, pool, max_pending=16))
    lives, span = [], 0
    for i, (prompt, prefix, flying, phase) in enumerate(reqs):
        r = Req(f"r{i}", prompt, prefix, 2, producer=f"p{i % (producers + 1)}")
        pages = s.pool.allocate(npages(prompt, prefix))[1]
        s = run(s, r.reserve(pages), r.computed())
        if phase == "admitted":
            s = run(s, r.issue(span), r.land(span), r.produced(), r.admit())
            span += 1
        elif phase == "failed" and prompt > prefix:
            s = run(s, r.issue(span), r.fail(span))
            span += 1
        for _ in range(flying):
            s = apply(s, r.issue(span, (0, 0), (prefix, prefix), 0))
            span += 1
        lives.append((r, pages, phase == "admitted" and not flying))
    for i in order:
        r, pages, can_release = lives[i]
        before = free_ids(s)
        s = apply(s, r.release() if can_release else r.abort())
        assert free_ids(s) == before | set(pages)
    assert s.free_pages == pool and free_ids(s) == set(range(pool))
    assert not s.requests and s.pending_of("p0") == s.pending_of("p1") == 0
    check_end(s)


# --- one focused example per code ----------------------------------------------------------


@pytest.fixture
def base():
    """A state with request r reserved (prompt 12, prefix 0, 3 layers) and all of it computed."""
    r = Req()
    return r, run(initial_state(header()), r.reserve(), r.computed())


def test_cfg1_layer_mode_recurrent():
    """CFG-1: layer mode is refused for a recurrent geometry; other combinations are fine."""
    with pytest.raises(Violation) as info:
        initial_state(header(mode="layer", recurrent=True))
    assert info.value.code == "CFG-1"
    initial_state(header(mode="chunk", recurrent=True))
    initial_state(header(mode="layer", recurrent=False))


def test_slab1_cases():
    """SLAB-1: wrong page count, id outside the pool, repeated id, page of another live slab."""
    s = initial_state(header(pool_pages=5))
    r = Req("a", 12, 0)
    assert refused(s, r.reserve(pages=(0, 1))) == "SLAB-1"
    assert refused(s, r.reserve(pages=(0, 1, 2, 3))) == "SLAB-1"
    assert refused(s, r.reserve(pages=(0, 1, 5))) == "SLAB-1"
    assert refused(s, r.reserve(pages=(0, 1, 1))) == "SLAB-1"
    s = apply(s, r.reserve(pages=(0, 1, 2)))
    assert refused(s, Req("b", 8, 0).reserve(pages=(2, 3))) == "SLAB-1"
    assert refused(s, Req("b", 12, 0).reserve(pages=(3, 4, 0))) == "SLAB-1"  # only 2 free
    assert not s.can_reserve(12, 0) and s.can_reserve(8, 0)
    s = apply(s, Req("b", 8, 0).reserve(pages=(4, 3)))
    assert s.free_pages == 0


def test_slab2_cases():
    """SLAB-2: prefix not page-aligned, prefix > prompt, prompt < 1; checked before SLAB-1."""
    s = initial_state(header())
    assert refused(s, Req("a", 12, 2).reserve(pages=(0, 1, 2))) == "SLAB-2"
    assert refused(s, ev.Reserve(0.0, "a", 4, 8, ())) == "SLAB-2"
    assert refused(s, ev.Reserve(0.0, "a", 0, 0, ())) == "SLAB-2"
    s = apply(s, ev.Reserve(0.0, "a", 8, 8, ()))  # empty suffix: no pages
    assert s.free_pages == 64


def test_req1_cases(base):
    """REQ-1: unknown or ended request, live re-reserve, reused span id, span not in flight."""
    r, s = base
    ghost = Req("ghost")
    for e in (ghost.computed(), ghost.issue(0), ghost.land(0), ghost.fail(0), ghost.reuse((0, 1)),
              ghost.produced(), ghost.admit(), ghost.release(), ghost.abort()):
        assert refused(s, e) == "REQ-1"
    assert refused(s, r.reserve(pages=(9, 10, 11))) == "REQ-1"
    assert refused(s, r.land(0)) == "REQ-1"
    s = run(s, r.issue(0, tokens=(0, 4)), r.land(0))
    assert refused(s, r.land(0)) == "REQ-1"  # landed twice
    assert refused(s, r.issue(0, tokens=(4, 8))) == "REQ-1"  # span id reused
    other = Req("o", first_page=3)
    s = run(s, other.reserve(), other.computed(), other.issue(1))
    assert refused(s, r.land(1)) == "REQ-1"  # another request's span
    s = apply(s, other.fail(1))
    assert refused(s, other.fail(1)) == "REQ-1"
    s = apply(s, other.abort())
    assert refused(s, other.produced()) == "REQ-1"
    s = run(s, other.reserve(), other.computed())  # a retry is a new life ...
    assert refused(s, other.issue(1, tokens=(0, 4))) == "REQ-1"  # ... but span ids stay used


def test_cov1_cases(base):
    """COV-1: a span below the prefix, past the prompt or past the last layer."""
    r = Req(prompt=12, prefix=4)
    s = run(initial_state(header()), r.reserve(), r.computed())
    assert refused(s, r.issue(0, tokens=(0, 8))) == "COV-1"
    assert refused(s, r.issue(0, tokens=(4, 13))) == "COV-1"
    assert refused(s, r.issue(0, layers=(2, 4))) == "COV-1"
    assert refused(s, r.issue(0, layers=(0, 4), size=1)) == "COV-1"  # COV-1 before COPY-4
    s = apply(s, r.issue(0, tokens=(40, 40), size=0))  # an empty range lies anywhere


def test_cov2_cases(base):
    """COV-2: issue overlapping a span in flight; land overlapping landed tokens."""
    r, s = base
    s = apply(s, r.issue(0, (1, 2), (3, 5)))
    assert refused(s, r.issue(1, (0, 3), (4, 6))) == "COV-2"
    s = run(s, r.issue(1, (0, 1), (3, 5)), r.land(0), r.issue(2, (1, 3), (0, 4)))
    assert refused(s, r.land(2)) == "COV-2"  # layer 1 token 3 already landed


def test_cov3_cases(base):
    """COV-3: admit with a layer or token not landed; COV-3 is checked before produced."""
    r, s = base
    assert refused(s, r.admit()) == "COV-3"  # not produced either: COV-3 wins
    s = run(s, r.produced(), r.issue(0, (0, 3), (0, 11)), r.land(0))
    assert refused(s, r.admit()) == "COV-3"
    s = run(s, r.issue(1, (0, 2), (11, 12)), r.land(1))
    assert refused(s, r.admit()) == "COV-3"
    s = run(s, r.issue(2, (2, 3), (11, 12)), r.land(2), r.admit())


def test_copy1_cases():
    """COPY-1: issue from a region never computed, or computed and then reused."""
    r = Req()
    s = run(initial_state(header()), r.reserve(), r.computed((0, 3), (0, 8)))
    assert refused(s, r.issue(0, tokens=(4, 12))) == "COPY-1"
    s = run(s, r.computed((0, 3), (8, 12)), r.reuse((2, 3)))
    assert refused(s, r.issue(0, tokens=(0, 4))) == "COPY-1"
    s = run(s, r.issue(0, tokens=(3, 12)), r.computed((0, 1), (2, 3)))
    assert refused(s, r.issue(1, (0, 2), (2, 3))) == "COPY-1"
    s = apply(s, r.issue(1, (0, 1), (2, 3)))


def test_copy2_cases():
    """COPY-2: a producer over max_pending, counted across requests and per producer."""
    a, b, c = Req("a"), Req("b", first_page=3), Req("c", first_page=6, producer="p1")
    s = run(initial_state(header(max_pending=2)), a.reserve(), a.computed(), b.reserve(),
            b.computed(), c.reserve(), c.computed())
    s = run(s, a.issue(0, tokens=(0, 4)), b.issue(1, tokens=(0, 4)))
    assert not s.can_issue("p0") and s.pending_of("p0") == 2
    assert refused(s, a.issue(2, tokens=(4, 8))) == "COPY-2"
    assert refused(s, a.issue(2, tokens=(0, 4))) == "COV-2"  # COV-2 before COPY-2
    s = run(s, c.issue(2, tokens=(0, 4)), c.issue(3, tokens=(4, 8)))
    s = apply(s, b.fail(1))
    s = apply(s, a.issue(4, tokens=(4, 8)))
    s = apply(s, a.abort())  # cancels spans 0 and 4
    assert s.pending_of("p0") == 0 and s.pending_of("p1") == 2


def test_copy3_cases(base):
    """COPY-3: reuse of tokens a span in flight reads; other tokens are fine."""
    r, s = base
    s = apply(s, r.issue(0, (2, 3), (4, 8)))
    assert refused(s, r.reuse((7, 9))) == "COPY-3"
    s = run(s, r.reuse((0, 4)), r.reuse((8, 12)), r.land(0), r.reuse((4, 8)))
    q = Req("q", first_page=3)
    s = run(s, q.reserve(), q.computed(), q.issue(1, (1, 1), (0, 12)))  # no layers: reads nothing
    s = apply(s, q.reuse((0, 12)))


def test_copy4_cases(base):
    """COPY-4: the claimed bytes differ from the region's KV bytes (empty spans are 0)."""
    r, s = base
    assert refused(s, r.issue(0, (0, 2), (0, 4), size=nbytes((0, 2), (0, 4)) + 1)) == "COPY-4"
    assert refused(s, r.issue(0, (0, 2), (3, 3), size=1)) == "COPY-4"
    s = apply(s, r.issue(0, (0, 2), (0, 4), size=2 * 4 * BPT))


def test_prod1_cases():
    """PROD-1: computed outside [0, L) x [0, prompt); produced before computed; twice."""
    r = Req(prompt=12, prefix=4)
    s = run(initial_state(header()), r.reserve())
    assert refused(s, r.computed((0, 4), (0, 4))) == "PROD-1"
    assert refused(s, r.computed((0, 3), (0, 13))) == "PROD-1"
    assert refused(s, r.produced()) == "PROD-1"
    s = apply(s, r.computed((0, 3), (4, 11)))
    assert refused(s, r.produced()) == "PROD-1"
    s = apply(s, r.computed((0, 2), (11, 12)))
    assert refused(s, r.produced()) == "PROD-1"  # the last layer's last token is missing
    s = run(s, r.computed((2, 3), (11, 12)), r.reuse((0, 12)), r.produced())
    assert refused(s, r.produced()) == "PROD-1"


def test_adm1_cases(base):
    """ADM-1: admit before produced, twice, with a span in flight, after a failure."""
    r, s = base
    s = run(s, r.issue(0), r.land(0))
    assert refused(s, r.admit()) == "ADM-1"  # not produced
    s = run(s, r.produced(), r.admit())
    assert refused(s, r.admit()) == "ADM-1"
    q = Req("q", first_page=3)
    s = run(s, q.reserve(), q.computed(), q.produced(), q.issue(1, (0, 3), (0, 4)))
    assert refused(s, q.admit()) == "ADM-1"  # in flight (and not covered)
    s = apply(s, q.fail(1))
    assert refused(s, q.admit()) == "ADM-1"


def test_life1_cases(base):
    """LIFE-1: release before admit; a complete trace may not end holding pages or spans."""
    r, s = base
    assert refused(s, r.release()) == "LIFE-1"
    with pytest.raises(Violation) as info:
        check_end(s)
    assert info.value.code == "LIFE-1"
    s = run(s, r.issue(0), r.land(0), r.produced(), r.admit(), r.release())
    check_end(s)
    e = Req("e", 8, 8)  # an empty suffix holds no pages: nothing to end
    check_end(apply(s, e.reserve()))


def test_empty_suffix_admits_after_produced():
    """prefix == prompt needs no span: admit right after produced."""
    r = Req("r", 8, 8)
    s = run(initial_state(header()), r.reserve(), r.produced(), r.admit(), r.release())
    assert not s.requests


def test_empty_span_may_land_after_admit():
    """An empty span publishes nothing, even after admission (was a ProgressError crash)."""
    r = Req("r", 8, 8)
    s = run(initial_state(header()), r.reserve(), r.produced(), r.admit(),
            r.issue(0, (0, 0), (8, 8), 0), r.land(0))
    s = run(s, r.release())
    assert s.pending_of("p0") == 0


def test_every_code_has_an_example():
    """Each code of the contract is exercised by a focused test in this file or the traces'."""
    here = {"CFG-1", "SLAB-1", "SLAB-2", "REQ-1", "COV-1", "COV-2", "COV-3", "COPY-1", "COPY-2",
            "COPY-3", "COPY-4", "PROD-1", "ADM-1", "LIFE-1"}
    # TRACE-1/2 live in test_pdref_traces.py; COPY-5 (v2 only) in test_pdref_fences.py;
    # version 3's in test_pdref_hybrid.py; version 4's in test_pdref_cache.py.
    assert set(CODES) - here == {"TRACE-1", "TRACE-2", "COPY-5", "STATE-1", "STATE-2",
                                 "STATE-3", "STATE-4", "SLIDE-1", "CACHE-1", "CACHE-2",
                                 "EVICT-1"}


test_partition_lands_and_admits_in_any_order = settings(max_examples=150)(
    test_partition_lands_and_admits_in_any_order)
