"""(v3) The transitions' checks that only a geometry with layer kinds has (apply.py calls them):
state slots, state spans, per-kind span bytes. Pure: each returns a value or raises the
Violation naming its code (specs/protocol.md gives the order)."""

from __future__ import annotations

from pdref import events as ev
from pdref.geometry import Geometry
from pdref.intervals import fmt
from pdref.state import RequestLife, Span, SystemState
from pdref.violations import Violation

_new = tuple.__new__


def slot_holder(layout, lives, unfenced, producer: str, slot) -> str | None:
    """Who may still write or read state slot `slot` of `producer`: a sentence naming the
    live life that holds it (until its every state landed) or the unfenced state span that
    reads it; None when free. `lives` and `unfenced` as the state or its mirror holds them."""
    for life in lives:
        if (life.state_slot == slot and life.producer == producer
                and layout.missing_state(life.states) is not None):
            return f"live request {life.req!r} holds it"
    for span_id, ended in unfenced.items():
        if ended.producer == producer and ended.span.slot == slot:
            return f"unfenced state span {span_id!r} of {ended.req!r} reads it"
    return None


def check_slot_free(state: SystemState, event: ev.Reserve) -> None:
    """STATE-4 at a reserve of a geometry with linear layers: it names a state slot of its
    producer that nobody may still write or read."""
    if event.state_slot is None:
        raise Violation("STATE-4", "a geometry with linear layers needs the reserve's "
                        "state_slot", event)
    holder = slot_holder(state.geometry.layout, state.requests.values(), state.unfenced,
                         event.producer, event.state_slot)
    if holder is not None:
        raise Violation("STATE-4", f"state slot {event.state_slot!r} of producer "
                        f"{event.producer!r} is not free: {holder}", event)


def check_state_write(layout, life: RequestLife, event: ev.Computed) -> None:
    """STATE-4 at a `computed` that writes a linear layer's state (any non-empty region on
    it) while a state span of the life reads that layer, or after its state landed (the
    slot is then no longer the life's)."""
    if event.tokens[1] <= event.tokens[0]:
        return
    written = layout.writes_linear(event.layers)
    while written is not None:
        for span in life.in_flight + life.unfenced:
            if span.slot is not None and _meets(span.layers, written):
                what = "in flight" if span in life.in_flight else "unfenced"
                raise Violation("STATE-4", f"computed writes the state of layers "
                                f"{fmt(written)} while state span {span.span!r} {what} "
                                "reads it", event)
        hit = life.states.first_overlap(written)
        if hit is not None:
            raise Violation("STATE-4", f"computed writes the state of layers {fmt(hit)} "
                            "after it landed (the slot is no longer this life's)", event)
        written = layout.writes_linear((written[1], event.layers[1]))


def _meets(x, y) -> bool:
    return x[0] < y[1] and y[0] < x[1]


def kv_span_bytes(geometry: Geometry, life: RequestLife, event: ev.Issue) -> int:
    """The bytes a KV span of a geometry with layer kinds must claim; SLIDE-1 when it
    claims those of its region with a sliding layer's tokens outside the window counted."""
    args = (event.layers, event.tokens, life.prompt, life.prefix, geometry.page_tokens)
    cells = geometry.layout.kv_cells(*args)
    unclipped = geometry.layout.kv_cells(*args, clip=False)
    per_cell = geometry.bytes_per_token_layer
    if unclipped != cells and event.bytes == unclipped * per_cell:
        raise Violation("SLIDE-1", f"span {fmt(event.layers)} x {fmt(event.tokens)} moves "
                        f"{event.bytes} bytes: a sliding layer's tokens outside its window "
                        f"counted (its KV is {cells * per_cell})", event)
    return cells * per_cell


def check_state_span(geometry: Geometry, life, computed, pending: int, max_pending: int,
                     event: ev.Issue) -> None:
    """The checks of a state span (v3), after REQ-1: of linear layers only (COV-1), at
    position `prompt` (STATE-1), claiming their state bytes (COPY-4), once each layer
    computed the whole suffix (`computed`, STATE-1), over no state landed or in flight
    (STATE-2), within `max_pending` (COPY-2). `life` is a RequestLife or the mirror's."""
    layers, layout = event.layers, geometry.layout
    if layout is None or not layout.all_linear(layers):
        raise Violation("COV-1", f"state span over layers {fmt(layers)}: a state span names "
                        "linear layers only", event)
    where = event.tokens
    if where != (life.prompt, life.prompt):
        raise Violation("STATE-1", f"state span at {fmt(where)}: a state is issued at "
                        f"[{life.prompt}, {life.prompt}), after the whole prompt", event)
    want = layout.state_bytes(layers)
    if event.bytes != want:
        raise Violation("COPY-4", f"state span over layers {fmt(layers)} claims "
                        f"{event.bytes} bytes, their state is {want}", event)
    gap = computed.first_gap(layers, (life.prefix, life.prompt))
    if gap is not None:
        raise Violation("STATE-1", f"state span issued mid-prompt: layer {gap[0]} has not "
                        f"computed tokens {fmt(gap[1])}", event)
    _check_once(life, layers, event)
    if pending >= max_pending:
        raise Violation("COPY-2", f"producer {life.producer!r} already has "
                        f"{max_pending} spans in flight or unfenced (max_pending)", event)


def state_span(life, event: ev.Issue) -> Span:
    """The Span of an accepted state span: it reads the life's state slot."""
    return _new(Span, (event.span, event.layers, event.tokens, event.bytes, life.state_slot))


def issue_state(state: SystemState, life: RequestLife, event: ev.Issue) -> SystemState:
    """The state after a state span's issue (`check_state_span` says what it needs)."""
    count = state.pending.get(life.producer, 0)
    check_state_span(state.geometry, life, life.computed, count, state.max_pending, event)
    return state.with_life(
        life.with_flight(life.in_flight + (state_span(life, event),)),
        pending=state.pending.set(life.producer, count + 1),
        spans_used=state.spans_used.set(event.span, event.req),
    )


def _check_once(life: RequestLife, layers, event) -> None:
    """STATE-2: no layer's state landed already or is in flight in another state span."""
    hit = life.states.first_overlap(layers)
    if hit is not None:
        raise Violation("STATE-2", f"the state of layers {fmt(hit)} already landed", event)
    for other in life.in_flight:
        if other.slot is not None and _meets(other.layers, layers):
            raise Violation("STATE-2", f"state span {other.span!r} in flight carries the "
                            f"state of layers {fmt(other.layers)} already", event)


def land_state(life: RequestLife, span: Span) -> RequestLife:
    """The life with a state span's layers' state landed (`_check_once` at its issue made
    sure no other lands it too)."""
    return life.replace(states=life.states.union(span.layers))
