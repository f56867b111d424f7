"""The transitions: `apply(state, event) -> state`, pure, raising a Violation naming its code.

Checks run in a fixed order per event (specs/protocol.md lists it), so an event that breaks
two rules always reports the same code. Here: the start (`initial_state`), a life's own
events (`reserve`, `computed`, `reuse`, `produced`, `admit`) and the table of every
transition; a span's events are span_apply.py's, a life's end and fences life_end.py's.
"""

from __future__ import annotations

from pdref import cache_apply as cache
from pdref import events as ev
from pdref import hybrid
from pdref.intervals import fmt
from pdref.life_end import apply_abort, apply_fence, apply_release, check_end
from pdref.pool import PoolError, QuarantineError
from pdref.progress import LayerProgress, empty_coverage
from pdref.span_apply import apply_fail, apply_issue, apply_land, live
from pdref.state import Phase, RequestLife, SystemState, hybrid_missing
from pdref.violations import Violation

__all__ = ["TRANSITIONS", "apply", "check_end", "initial_state"]


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


def apply_reuse(state: SystemState, event: ev.Reuse) -> SystemState:
    life = live(state, event)
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
    life = live(state, event)
    if life.phase is not Phase.RESERVED:
        raise Violation("PROD-1", f"request {event.req!r} was already produced", event)
    gap = life.computed.first_gap((0, state.geometry.layers), life.suffix)
    if gap is not None:
        raise Violation("PROD-1", f"produced before layer {gap[0]} computed tokens "
                        f"{fmt(gap[1])}", event)
    return state.with_life(life.replace(phase=Phase.PRODUCED))


def apply_admit(state: SystemState, event: ev.Admit) -> SystemState:
    life = live(state, event)
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
