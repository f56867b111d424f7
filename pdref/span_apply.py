"""A span's transitions: `issue`, `land`, `fail`; and the two look-ups every transition
shares (the event's live life, a producer's pending count)."""

from __future__ import annotations

from pdref import cache_apply as cache
from pdref import events as ev
from pdref import hybrid
from pdref.intervals import fmt
from pdref.progress import ProgressError
from pdref.state import RequestLife, Span, SystemState, Unfenced
from pdref.violations import Violation

_new = tuple.__new__  # a NamedTuple made without its generated __new__ (one call less)


def live(state: SystemState, event) -> RequestLife:
    """The live life the event names, or REQ-1."""
    life = state.requests.get(event.req)
    if life is None:
        raise Violation("REQ-1", f"request {event.req!r} is not live", event)
    return life


def adjust_pending(state: SystemState, producer: str, delta: int):
    """The pending map with `producer`'s count moved by `delta`."""
    return state.pending.set(producer, state.pending.get(producer, 0) + delta)


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
    life = live(state, event)
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
                               pending=adjust_pending(state, life.producer, -1))
    # v2: its writer may still write and still holds its slot until the fence.
    return state.with_life(
        life.replace(failed=True, in_flight=rest, unfenced=life.unfenced + (span,)),
        unfenced=state.unfenced.set(span.span, Unfenced(span, life.req, life.producer,
                                                        life.serial)),
    )
