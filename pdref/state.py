"""The whole protocol state as immutable values, and the queries the shells drive it with.

`Span`, `RequestLife` and `SystemState` are NamedTuples, not attrs frozen classes like the
rest of pdref: every checked event builds a new life and a new state (an issue also a
span), and attrs' frozen `__init__` sets each field through `object.__setattr__` (about
90 ns a field: 1.3 us for a state), where a tuple is made in one step. They are just as
immutable; `replace(**changes)` stands in for `attrs.evolve`.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import attrs
import immutables

from pdref.events import Header, Mode, SpanId
from pdref.geometry import Geometry
from pdref.intervals import IntervalSet, Range, fmt, overlaps
from pdref.pool import Pool
from pdref.progress import Coverage, LayerProgress

DECODER = ""  # (v4) the decoder's prefix cache's owner key (a producer's name is never empty)

_new = tuple.__new__  # a NamedTuple made without its generated __new__ (one call less)


class Phase(enum.Enum):
    RESERVED = "reserved"
    PRODUCED = "produced"
    ADMITTED = "admitted"


class Span(NamedTuple):
    """A copy in flight: the region it reads and the bytes it moves; (v3) a state span
    names the producer's state slot it reads (`slot`; None: a KV span)."""

    span: SpanId
    layers: Range
    tokens: Range
    bytes: int
    slot: SpanId | None = None

    def reads(self, tokens: Range) -> bool:
        """True when the span reads any of `tokens` (on any layer)."""
        return self.layers[0] < self.layers[1] and overlaps(self.tokens, tokens)

    def meets(self, other: Span) -> bool:
        """True when the two spans' regions share a (layer, token) point."""
        return overlaps(self.layers, other.layers) and overlaps(self.tokens, other.tokens)


class RequestLife(NamedTuple):
    """One life of a request: from `reserve` to `release` or `abort`."""

    req: str
    producer: str
    prompt: int
    prefix: int
    pages: tuple[int, ...]
    progress: LayerProgress
    computed: Coverage  # every region the producer ever computed in this life
    held: Coverage  # computed and not reused since: what a span may read
    phase: Phase = Phase.RESERVED
    in_flight: tuple[Span, ...] = ()
    failed: bool = False
    serial: int = 0  # which life of the trace this is (the n-th reserve): names it after it ended
    unfenced: tuple[Span, ...] = ()  # (v2) failed spans whose writer may still write
    state_slot: SpanId | None = None  # (v3) the producer's state slot of its linear layers
    states: IntervalSet = IntervalSet()  # (v3) linear layers whose state landed
    refs: LifeRefs | None = None  # (v4) the cached pages it holds; None: none ever

    @property
    def suffix(self) -> Range:
        return (self.prefix, self.prompt)

    def replace(self, **changes) -> RequestLife:
        return self._replace(**changes)

    # The hot transitions build the next life positionally (no generic replace).
    def with_coverage(self, computed: Coverage, held: Coverage) -> RequestLife:
        req, producer, prompt, prefix, pages, progress, _, _, *rest = self
        return _new(RequestLife, (req, producer, prompt, prefix, pages, progress, computed,
                                  held, *rest))

    def with_flight(self, in_flight: tuple[Span, ...], progress: LayerProgress | None = None):
        """The life with these spans in flight and, after a land, its new progress."""
        (req, producer, prompt, prefix, pages, old, computed, held, phase, _, failed, serial,
         unfenced, state_slot, states, refs) = self
        return _new(RequestLife, (req, producer, prompt, prefix, pages,
                                  old if progress is None else progress, computed, held, phase,
                                  in_flight, failed, serial, unfenced, state_slot, states, refs))

    def find_span(self, span: SpanId) -> Span | None:
        for s in self.in_flight:
            if s.span == span:
                return s
        return None


class CachedPage(NamedTuple):
    """(v4) A page of a prefix cache: the first token position it holds (its KV is that of
    tokens [first, first + page_tokens) of a prompt), how many hold it (live lives that hit,
    published or copy from it, and unfenced spans of ended lives that read it), and whether
    it holds the sliding layers' KV too (a decoder page below its life's window does not)."""

    first: int
    refs: int
    sliding: bool = True


class LifeRefs(NamedTuple):
    """(v4) The cached pages one life holds, each counted once in its page's `refs`."""

    hits: tuple[int, ...] = ()  # the decoder's pages of its reserve's hit: [0, prefix)
    published: tuple[int, ...] = ()  # its slab's pages it put into the decoder's cache
    cached: IntervalSet = IntervalSet()  # their tokens: no span of it may write them
    sources: tuple[tuple[SpanId, int], ...] = ()  # its producer's cached pages it copies
    # from, as (page id, first token)


@attrs.frozen
class Unfenced:
    """(v2) A span that ended without landing (failed or cancelled) and is not fenced yet."""

    span: Span
    req: str
    producer: str
    life: int  # the serial of the life that issued it
    # (v4) the producer's cached pages it reads, held for it once its life ended
    pins: tuple[SpanId, ...] = ()


@attrs.frozen
class Quarantine:
    """(v2) The pages of an aborted life, held until its last unfenced span is fenced."""

    req: str
    pages: tuple[int, ...]
    unfenced: int  # how many of its spans are still unfenced (>= 1)


def hybrid_missing(geometry: Geometry, landed: Coverage, life) -> tuple[str, str] | None:
    """(v3) (code, sentence) of what a life (a RequestLife or the mirror's) of a geometry
    with layer kinds still needs before admission, `landed` being its landed KV: KV per
    kind (COV-3), then every linear layer's state (STATE-3); None when nothing is missing."""
    layout = geometry.layout
    gap = layout.first_gap(landed, life.prompt, life.prefix, geometry.page_tokens)
    if gap is not None:
        return "COV-3", f"layer {gap[0]} has not landed tokens {fmt(gap[1])}"
    layer = layout.missing_state(life.states)
    if layer is not None:
        return "STATE-3", f"the state of linear layer {layer} has not landed"
    return None


class SystemState(NamedTuple):
    """The decoder pool, every live request, the producers' in-flight counts, used span ids,
    and (v2) the unfenced spans and the quarantined slabs of ended lives."""

    geometry: Geometry
    mode: Mode
    max_pending: int
    pool: Pool
    requests: immutables.Map = immutables.Map()  # req -> RequestLife
    pending: immutables.Map = immutables.Map()  # producer -> spans in flight or unfenced
    spans_used: immutables.Map = immutables.Map()  # span id -> req, never forgotten
    version: int = 2
    lives: int = 0  # lives started so far: the next life's serial
    unfenced: immutables.Map = immutables.Map()  # span id -> Unfenced
    quarantine: immutables.Map = immutables.Map()  # life serial -> Quarantine
    # (v4) prefix caches: owner (DECODER or a producer) -> Map(page id -> CachedPage)
    caches: immutables.Map = immutables.Map()

    @classmethod
    def initial(cls, header: Header) -> SystemState:
        return cls(header.geometry, header.mode, header.max_pending, Pool(header.pool_pages),
                   version=header.version)

    @property
    def fences(self) -> bool:
        """Version 2: an ended writer must be fenced before its pages or slot are reused."""
        return self.version >= 2

    @property
    def free_pages(self) -> int:
        return self.pool.free_pages

    def pending_of(self, producer: str = "p0") -> int:
        return self.pending.get(producer, 0)

    def live(self, req: str) -> RequestLife | None:
        return self.requests.get(req)

    def pages_needed(self, prompt: int, prefix: int) -> int:
        return self.geometry.pages_for(prompt - prefix)

    def can_reserve(self, prompt: int, prefix: int) -> bool:
        return self.pages_needed(prompt, prefix) <= self.free_pages

    def can_issue(self, producer: str = "p0") -> bool:
        return self.pending_of(producer) < self.max_pending

    def can_admit(self, req: str) -> bool:
        life = self.live(req)
        return (
            life is not None
            and life.phase is Phase.PRODUCED
            and not life.in_flight
            and not life.failed
            and (life.progress.is_complete() if self.geometry.layout is None
                 else hybrid_missing(self.geometry, life.progress.landed, life) is None)
        )

    def replace(self, **changes) -> SystemState:
        return self._replace(**changes)

    def with_life(self, life: RequestLife, pool=None, pending=None, spans_used=None,
                  lives=None, unfenced=None):
        """The state with `life` stored (the hot path of every event: no generic replace)."""
        (geometry, mode, max_pending, old_pool, requests, old_pending, old_used, version,
         old_lives, old_unfenced, quarantine, caches) = self
        return _new(SystemState, (
            geometry, mode, max_pending,
            old_pool if pool is None else pool,
            requests.set(life[0], life),
            old_pending if pending is None else pending,
            old_used if spans_used is None else spans_used,
            version,
            old_lives if lives is None else lives,
            old_unfenced if unfenced is None else unfenced,
            quarantine, caches,
        ))

    def unfenced_of(self, req: str) -> tuple[SpanId, ...]:
        """Span ids of request id `req` (any of its lives) that still need a fence."""
        return tuple(span for span, u in self.unfenced.items() if u.req == req)

    def open_requests(self) -> list[RequestLife]:
        """Live requests that still hold pages or spans in flight (LIFE-1 at trace end)."""
        return [life for life in self.requests.values() if life.pages or life.in_flight]

