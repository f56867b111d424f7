"""The transitions: `apply(state, event) -> state`, pure, raising a Violation naming its code.

Checks run in a fixed order per event (specs/protocol.md lists it), so an event that breaks
two rules always reports the same code.
"""

from __future__ import annotations

from pdref import cache_apply as cache
from pdref import events as ev
from pdref import hybrid
from pdref.intervals import fmt
from pdref.pool import PoolError, QuarantineError
from pdref.progress import LayerProgress, ProgressError, empty_coverage
from pdref.state import (
    Phase,
    Quarantine,
    RequestLife,
    Span,
    SystemState,
    Unfenced,
    hybrid_missing,
)
from pdref.violations import Violation

_new = tuple.__new__  # a NamedTuple made without its generated __new__ (one call less)


def initial_state(header: ev.Header) -> SystemState:
    """The state before any event; CFG-1 refuses layer streaming of a recurrent model whose
    layer kinds are not named (its state would cross unchecked)."""
    geometry = header.geometry
    if geometry.kinds is not None and header.version < 3:
        raise Violation("TRACE-1", f"layer kinds need version 3, the header says "
                        f"{header.version}", header)
    if header.mode is ev.Mode.LAYER and geometry.recurrent and geometry.kinds is None:
        raise Violation("CFG-1", "mode layer is refused for a recurrent geometry that names "
                        "no layer kinds", header)
    return SystemState.initial(header)


def _live(state: SystemState, event) -> RequestLife:
    life = state.requests.get(event.req)
    if life is None:
        raise Violation("REQ-1", f"request {event.req!r} is not live", event)
    return life


def _adjust_pending(state: SystemState, producer: str, delta: int):
    return state.pending.set(producer, state.pending.get(producer, 0) + delta)


def apply_reserve(state: SystemState, event: ev.Reserve) -> SystemState:
    if event.req in state.requests:
        raise Violation("REQ-1", f"request {event.req!r} is already live", event)
    page_tokens = state.geometry.page_tokens
    if event.prompt < 1 or not 0 <= event.prefix <= event.prompt:
        raise Violation("SLAB-2", f"needs prompt >= 1 and 0 <= prefix <= prompt, got "
                        f"prompt {event.prompt}, prefix {event.prefix}", event)
    if event.prefix % page_tokens:
        raise Violation("SLAB-2", f"prefix {event.prefix} is not a multiple of "
                        f"page_tokens {page_tokens}", event)
    need = state.pages_needed(event.prompt, event.prefix)
    if len(event.pages) != need:
        raise Violation("SLAB-1", f"got {len(event.pages)} pages, needs exactly {need}", event)
    try:
        pool = state.pool.take(event.pages)
    except QuarantineError as e:
        raise Violation("COPY-5", str(e), event) from None
    except PoolError as e:
        raise Violation("SLAB-1", cache.cached_slab_page(state, event) or str(e),
                        event) from None
    caches, refs = state.caches, None
    if event.hit is not None:  # (v4) the decoder's cached pages of [0, prefix)
        caches, refs = cache.reserve_hit(state, event)
    if state.geometry.recurrent and state.geometry.layout is not None:
        hybrid.check_slot_free(state, event)
    layers = state.geometry.layers
    empty = empty_coverage(layers)
    life = RequestLife(
        req=event.req, producer=event.producer, prompt=event.prompt, prefix=event.prefix,
        pages=event.pages, progress=LayerProgress(layers, event.prefix, event.prompt),
        computed=empty, held=empty, serial=state.lives, state_slot=event.state_slot, refs=refs,
    )
    state = state.with_life(life, pool=pool, lives=state.lives + 1)
    return state if refs is None else state.replace(caches=caches)


def apply_computed(state: SystemState, event: ev.Computed) -> SystemState:
    life = state.requests.get(event.req)
    if life is None:
        raise Violation("REQ-1", f"request {event.req!r} is not live", event)
    layers, tokens = event.layers, event.tokens
    (l0, l1), (a, b) = layers, tokens  # `contains` inlined: this runs on every step
    if not ((l1 <= l0 or (0 <= l0 and l1 <= state.geometry.layers))
            and (b <= a or (0 <= a and b <= life.prompt))):
        raise Violation("PROD-1", f"computed {fmt(layers)} x {fmt(tokens)} is outside "
                        f"[0, {state.geometry.layers}) x [0, {life.prompt})", event)
    if state.geometry.recurrent and state.geometry.layout is not None:
        hybrid.check_state_write(state.geometry.layout, life, event)
    if event.hit is not None:  # (v4) from its producer's cached pages
        state = cache.computed_hit(state, life, event)
        life = state.requests[event.req]
    computed = life.computed.union(layers, tokens)
    # Until the first reuse, held and computed are the same value: extend it once.
    held = computed if life.held is life.computed else life.held.union(layers, tokens)
    return state.with_life(life.with_coverage(computed, held))


def apply_issue(state: SystemState, event: ev.Issue) -> SystemState:
    life = state.requests.get(event.req)
    if life is None:
        raise Violation("REQ-1", f"request {event.req!r} is not live", event)
    span_id, layers, tokens = event.span, event.layers, event.tokens
    if span_id in state.spans_used:
        raise Violation("REQ-1", f"span id {span_id!r} was used before", event)
    if event.state:
        return hybrid.issue_state(state, life, event)
    geometry = state.geometry
    (l0, l1), (a, b) = layers, tokens  # `contains` and `region_bytes` inlined: every span
    if not ((l1 <= l0 or (0 <= l0 and l1 <= geometry.layers))
            and (b <= a or (life.prefix <= a and b <= life.prompt))):
        raise Violation("COV-1", f"span {_region(event)} is outside "
                        f"[0, {geometry.layers}) x {fmt(life.suffix)}", event)
    if life.refs is not None:  # (v4) it never writes a cached page
        cache.check_span_write(life, event)
    if geometry.layout is None:
        want = (geometry.bytes_per_token_layer * (l1 - l0 if l1 > l0 else 0)
                * (b - a if b > a else 0))
    else:
        want = hybrid.kv_span_bytes(geometry, life, event)
    if event.bytes != want:
        raise Violation("COPY-4", f"span {_region(event)} claims {event.bytes} bytes, "
                        f"its KV is {want}", event)
    gap = life.held.first_gap(layers, tokens)
    if gap is not None:
        raise Violation("COPY-1", f"layer {gap[0]} tokens {fmt(gap[1])} are not computed "
                        "or were reused", event)
    for other in life.in_flight:  # `Span.meets` inlined
        (o0, o1), (x, y) = other.layers, other.tokens
        if l0 < o1 and o0 < l1 and l0 < l1 and o0 < o1 and a < y and x < b and a < b and x < y:
            raise Violation("COV-2", f"span {_region(event)} overlaps span {other.span!r} "
                            "in flight", event)
    producer, pending = life.producer, state.pending
    count = pending.get(producer, 0)
    if count >= state.max_pending:
        raise Violation("COPY-2", f"producer {producer!r} already has "
                        f"{state.max_pending} spans in flight or unfenced (max_pending)", event)
    span = _new(Span, (span_id, layers, tokens, event.bytes, None))
    return state.with_life(
        life.with_flight(life.in_flight + (span,)),
        pending=pending.set(producer, count + 1),
        spans_used=state.spans_used.set(span_id, event.req),
    )


def _region(event) -> str:
    return f"{fmt(event.layers)} x {fmt(event.tokens)}"


def _retire(state: SystemState, event) -> tuple[tuple[Span, ...], RequestLife, Span]:
    """(the other spans in flight, the live request, its span) named by a land/fail event."""
    life = _live(state, event)
    in_flight = life.in_flight
    if in_flight and in_flight[0].span == event.span:  # the usual order: oldest lands first
        return in_flight[1:], life, in_flight[0]
    span = life.find_span(event.span)
    if span is None:
        raise Violation("REQ-1", f"span {event.span!r} is not in flight for {event.req!r}", event)
    return tuple(s for s in in_flight if s is not span), life, span


def apply_land(state: SystemState, event: ev.Land) -> SystemState:
    life = state.requests.get(event.req)
    in_flight = life.in_flight if life is not None else ()
    if in_flight and in_flight[0].span == event.span:  # the usual order: oldest lands first
        rest, span = in_flight[1:], in_flight[0]
    else:
        rest, life, span = _retire(state, event)
    progress = life.progress
    (l0, l1), (a, b) = layers, tokens = span.layers, span.tokens
    if l0 < l1 and a < b:  # an empty span publishes nothing
        try:
            progress = progress.add(layers, tokens)
        except ProgressError as e:  # bounds were checked at issue (COV-1): this is overlap
            raise Violation("COV-2", f"span {event.span!r} cannot land: {e}", event) from None
    elif span.slot is not None:  # (v3) a state span publishes its layers' state
        life = hybrid.land_state(life, span)
    producer, pending = life.producer, state.pending
    return state.with_life(life.with_flight(rest, progress),
                           pending=pending.set(producer, pending.get(producer, 0) - 1))


def apply_fail(state: SystemState, event: ev.Fail) -> SystemState:
    rest, life, span = _retire(state, event)
    if not state.fences:  # v1: the span's slot is free at once
        return state.with_life(life.replace(failed=True, in_flight=rest),
                               pending=_adjust_pending(state, life.producer, -1))
    # v2: its writer may still write and still holds its slot until the fence.
    return state.with_life(
        life.replace(failed=True, in_flight=rest, unfenced=life.unfenced + (span,)),
        unfenced=state.unfenced.set(span.span, Unfenced(span, life.req, life.producer,
                                                        life.serial)),
    )


def apply_reuse(state: SystemState, event: ev.Reuse) -> SystemState:
    life = _live(state, event)
    for span in life.in_flight + life.unfenced:
        if span.reads(event.tokens):
            what = "in flight" if span in life.in_flight else "unfenced"
            raise Violation("COPY-3", f"reuse of tokens {fmt(event.tokens)} while span "
                            f"{span.span!r} {what} reads {fmt(span.tokens)}", event)
    life = life.replace(held=life.held.remove_tokens(event.tokens))
    state = state.with_life(life)
    if life.refs is not None and life.refs.sources:  # (v4) lets go of freed source pages
        state = cache.apply_reuse_refs(state, life, event.tokens)
    return state


def apply_produced(state: SystemState, event: ev.Produced) -> SystemState:
    life = _live(state, event)
    if life.phase is not Phase.RESERVED:
        raise Violation("PROD-1", f"request {event.req!r} was already produced", event)
    gap = life.computed.first_gap((0, state.geometry.layers), life.suffix)
    if gap is not None:
        raise Violation("PROD-1", f"produced before layer {gap[0]} computed tokens "
                        f"{fmt(gap[1])}", event)
    return state.with_life(life.replace(phase=Phase.PRODUCED))


def apply_admit(state: SystemState, event: ev.Admit) -> SystemState:
    life = _live(state, event)
    if life.phase is Phase.ADMITTED:
        raise Violation("ADM-1", f"request {event.req!r} was already admitted", event)
    if life.failed:
        raise Violation("ADM-1", f"request {event.req!r} has a failed span", event)
    if life.in_flight:
        raise Violation("ADM-1", f"span {life.in_flight[0].span!r} is still in flight", event)
    if state.geometry.layout is None:
        gap = life.progress.missing()
        if gap is not None:
            raise Violation("COV-3", f"layer {gap[0]} has not landed tokens {fmt(gap[1])}",
                            event)
    else:
        missing = hybrid_missing(state.geometry, life.progress.landed, life)
        if missing is not None:
            raise Violation(*missing, event)
    if life.phase is not Phase.PRODUCED:
        raise Violation("ADM-1", f"admit before produced for {event.req!r}", event)
    done = life.replace(phase=Phase.ADMITTED, progress=life.progress.finished_now())
    return state.with_life(done)


def _end_life(state: SystemState, life: RequestLife) -> SystemState:
    if life.refs is not None:  # (v4) its cached pages are let go, not given back
        state, life, pins = cache.end_refs(state, life)
        return cache.with_pins(_end_life_fenced(state, life), pins)
    if state.fences:
        return _end_life_fenced(state, life)
    pending = state.pending
    if life.in_flight:  # abort cancels them
        pending = _adjust_pending(state, life.producer, -len(life.in_flight))
    return state.replace(requests=state.requests.delete(life.req),
                        pool=state.pool.give_back(life.pages), pending=pending)


def _end_life_fenced(state: SystemState, life: RequestLife) -> SystemState:
    """v2: spans in flight are cancelled and become unfenced (their slots stay taken); the
    pages go back now if no writer is unfenced, else they are quarantined until the last
    fence."""
    requests = state.requests.delete(life.req)
    writers = life.unfenced + life.in_flight
    if not writers:
        return state.replace(requests=requests, pool=state.pool.give_back(life.pages))
    unfenced = state.unfenced
    for span in life.in_flight:
        unfenced = unfenced.set(span.span, Unfenced(span, life.req, life.producer, life.serial))
    held = Quarantine(life.req, life.pages, len(writers))
    return state.replace(requests=requests, pool=state.pool.quarantine(life.pages),
                         unfenced=unfenced, quarantine=state.quarantine.set(life.serial, held))


def apply_release(state: SystemState, event: ev.Release) -> SystemState:
    life = _live(state, event)
    if life.phase is not Phase.ADMITTED:
        raise Violation("LIFE-1", f"release of {event.req!r} before admit", event)
    return _end_life(state, life)


def apply_abort(state: SystemState, event: ev.Abort) -> SystemState:
    return _end_life(state, _live(state, event))


def apply_fence(state: SystemState, event: ev.Fence) -> SystemState:
    """(v2) The writer of an unfenced span stopped: its slot is free; if its life ended and
    this was its last unfenced span, the quarantined pages go back to the pool."""
    ended = state.unfenced.get(event.span)
    if ended is None or ended.req != event.req:
        raise Violation("REQ-1", f"span {event.span!r} of {event.req!r} is not unfenced "
                        "(never failed or cancelled, never issued, or fenced already)", event)
    state = state.replace(unfenced=state.unfenced.delete(event.span),
                          pending=_adjust_pending(state, ended.producer, -1))
    if ended.pins:  # (v4) it read cached pages of its producer for an ended life
        state = cache.unpin(state, ended)
    life = state.requests.get(event.req)
    if life is not None and life.serial == ended.life:
        rest = tuple(s for s in life.unfenced if s.span != event.span)
        return state.with_life(life.replace(unfenced=rest))
    return _fence_quarantine(state, ended.life)


def _fence_quarantine(state: SystemState, serial: int) -> SystemState:
    held = state.quarantine[serial]
    if held.unfenced > 1:
        fewer = Quarantine(held.req, held.pages, held.unfenced - 1)
        return state.replace(quarantine=state.quarantine.set(serial, fewer))
    return state.replace(quarantine=state.quarantine.delete(serial),
                         pool=state.pool.unquarantine(held.pages))


def apply_stage(state: SystemState, event: ev.Stage) -> SystemState:
    return state


TRANSITIONS = {  # event class -> its transition
    ev.Reserve: apply_reserve, ev.Computed: apply_computed, ev.Issue: apply_issue,
    ev.Land: apply_land, ev.Fail: apply_fail, ev.Reuse: apply_reuse,
    ev.Produced: apply_produced, ev.Admit: apply_admit, ev.Release: apply_release,
    ev.Abort: apply_abort, ev.Fence: apply_fence, ev.Stage: apply_stage,
    ev.Cache: cache.apply_cache, ev.Evict: cache.apply_evict,
}


def apply(state: SystemState, event) -> SystemState:
    """The state after `event`, or a Violation naming the rule it breaks."""
    return TRANSITIONS[type(event)](state, event)


def check_end(state: SystemState) -> None:
    """LIFE-1 at the end of a complete trace: nothing holds pages or spans in flight, and
    (v2) no span is unfenced."""
    open_lives = state.open_requests()
    if state.unfenced and not open_lives:
        span, ended = next(iter(state.unfenced.items()))
        raise Violation("LIFE-1", f"trace ends with span {span!r} of {ended.req!r} unfenced")
    if open_lives:
        life = open_lives[0]
        what = "spans in flight" if life.in_flight else f"{len(life.pages)} pages"
        raise Violation("LIFE-1", f"trace ends with request {life.req!r} holding {what}")
