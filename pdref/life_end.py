"""The end of a life: `release`, `abort`, and (v2) `fence`, which frees a stopped writer's
slot and gives quarantined pages back; and the end-of-trace check."""

from __future__ import annotations

from pdref import cache_apply as cache
from pdref import events as ev
from pdref.span_apply import adjust_pending, live
from pdref.state import Phase, Quarantine, RequestLife, SystemState, Unfenced
from pdref.violations import Violation


def _end_life(state: SystemState, life: RequestLife) -> SystemState:
    if life.refs is not None:  # (v4) its cached pages are let go, not given back
        state, life, pins = cache.end_refs(state, life)
        return cache.with_pins(_end_life_fenced(state, life), pins)
    if state.fences:
        return _end_life_fenced(state, life)
    pending = state.pending
    if life.in_flight:  # abort cancels them
        pending = adjust_pending(state, life.producer, -len(life.in_flight))
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
    life = live(state, event)
    if life.phase is not Phase.ADMITTED:
        raise Violation("LIFE-1", f"release of {event.req!r} before admit", event)
    return _end_life(state, life)


def apply_abort(state: SystemState, event: ev.Abort) -> SystemState:
    return _end_life(state, live(state, event))


def apply_fence(state: SystemState, event: ev.Fence) -> SystemState:
    """(v2) The writer of an unfenced span stopped: its slot is free; if its life ended and
    this was its last unfenced span, the quarantined pages go back to the pool."""
    ended = state.unfenced.get(event.span)
    if ended is None or ended.req != event.req:
        raise Violation("REQ-1", f"span {event.span!r} of {event.req!r} is not unfenced "
                        "(never failed or cancelled, never issued, or fenced already)", event)
    state = state.replace(unfenced=state.unfenced.delete(event.span),
                          pending=adjust_pending(state, ended.producer, -1))
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
