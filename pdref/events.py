"""The events of the trace contract as immutable values (specs/contract.md, 'Events')."""

from __future__ import annotations

import enum
from typing import ClassVar

import attrs

from pdref.geometry import Geometry
from pdref.intervals import Range

VERSION = 2  # what writers write for a geometry without layer kinds (v3 means the same there)
HYBRID_VERSION = 3  # what they write for one with layer kinds (v3: hybrid models)
CACHE_VERSION = 4  # what they write when a prefix cache's pages are named (v4: prefix cache)
VERSIONS = (1, 2, 3, 4)


class Mode(enum.StrEnum):
    WHOLE = "whole"
    CHUNK = "chunk"
    LAYER = "layer"


SpanId = int | str


@attrs.frozen
class Header:
    """Line 1 of a trace: who wrote it, the mode, the KV geometry and the pool."""

    kind: ClassVar[str] = "header"
    source: str
    mode: Mode = attrs.field(converter=Mode)
    geometry: Geometry
    pool_pages: int
    max_pending: int
    version: int = attrs.field(default=attrs.Factory(
        lambda self: HYBRID_VERSION if self.geometry.kinds is not None else VERSION,
        takes_self=True))
    # Extra header fields (e.g. chunk, link_gbps, hw) as sorted (key, value) pairs.
    extra: tuple[tuple[str, object], ...] = ()

    def get(self, key: str, default=None):
        return dict(self.extra).get(key, default)


@attrs.frozen
class Reserve:
    kind: ClassVar[str] = "reserve"
    t: float
    req: str
    prompt: int
    prefix: int
    pages: tuple[int, ...] = attrs.field(converter=tuple)
    producer: str = "p0"
    # (v3) the producer's state slot this life's linear layers compute into and its state
    # spans read; needed when the geometry has linear layers
    state_slot: SpanId | None = None
    # (v4) the decoder's cached pages that hold [0, prefix), in token order (a cache hit)
    hit: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(
        tuple))


@attrs.frozen
class Computed:
    kind: ClassVar[str] = "computed"
    t: float
    req: str
    layers: Range
    tokens: Range
    # (v4) the producer's cached pages the region comes from, in token order (a cache hit:
    # nothing was computed, the source is those shared pages)
    hit: tuple[SpanId, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple))


@attrs.frozen
class Issue:
    kind: ClassVar[str] = "issue"
    t: float
    req: str
    span: SpanId
    layers: Range
    tokens: Range
    bytes: int
    # (v3) a state span: the recurrent state of its (linear) layers at position tokens[0]
    state: bool = False


@attrs.frozen
class Land:
    kind: ClassVar[str] = "land"
    t: float
    req: str
    span: SpanId


@attrs.frozen
class Fail:
    kind: ClassVar[str] = "fail"
    t: float
    req: str
    span: SpanId
    error: str


@attrs.frozen
class Reuse:
    kind: ClassVar[str] = "reuse"
    t: float
    req: str
    tokens: Range


@attrs.frozen
class Produced:
    kind: ClassVar[str] = "produced"
    t: float
    req: str
    token: int


@attrs.frozen
class Admit:
    kind: ClassVar[str] = "admit"
    t: float
    req: str


@attrs.frozen
class Release:
    kind: ClassVar[str] = "release"
    t: float
    req: str


@attrs.frozen
class Abort:
    kind: ClassVar[str] = "abort"
    t: float
    req: str
    reason: str


@attrs.frozen
class Fence:
    """(v2) The writer of a failed or cancelled span has stopped and will write nothing more."""

    kind: ClassVar[str] = "fence"
    t: float
    req: str
    span: SpanId


@attrs.frozen
class Cache:
    """(v4) Pages enter a prefix cache: without `producer`, the decoder's (pages of the life's
    slab holding `tokens`); with it, that producer's source cache (new page ids holding the
    life's computed `tokens`)."""

    kind: ClassVar[str] = "cache"
    t: float
    req: str
    tokens: Range
    pages: tuple[SpanId, ...] = attrs.field(converter=tuple)
    producer: str | None = None


@attrs.frozen
class Evict:
    """(v4) Cached pages leave the decoder's cache (no `producer`: back to the pool) or that
    producer's; `req` names who the room is for and need not be live."""

    kind: ClassVar[str] = "evict"
    t: float
    req: str
    pages: tuple[SpanId, ...] = attrs.field(converter=tuple)
    producer: str | None = None


@attrs.frozen
class Stage:
    """Informational timing of one piece of work from t to end; checked for form only."""

    kind: ClassVar[str] = "stage"
    t: float
    req: str
    name: str
    end: float
    span: SpanId | None = None
    resource: str | None = None
    # Extension (contract v1 allows extra fields): the prompt tokens a compute stage
    # prefilled, so calibration can fit compute cost per chunk.
    tokens: Range | None = None
    # Extension: a decode step's batch (requests decoded together) and the KV tokens it read,
    # so calibration can fit a decode step's time as a function of both.
    batch: int | None = None
    kv_tokens: int | None = None


Event = (
    Reserve | Computed | Issue | Land | Fail | Reuse | Produced | Admit | Release | Abort | Fence
    | Cache | Evict | Stage
)
EVENT_TYPES: dict[str, type] = {
    cls.kind: cls
    for cls in (Reserve, Computed, Issue, Land, Fail, Reuse, Produced, Admit, Release, Abort, Fence,
                Cache, Evict, Stage)
}


def event_to_json(event) -> dict:
    """The JSON object of one event line (ranges as two-element lists, None fields and a
    false `state` left out)."""
    out = {"kind": event.kind}
    for field in attrs.fields(type(event)):
        value = getattr(event, field.name)
        if value is None or (value is False and field.default is False):
            continue
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out


def header_to_json(header: Header) -> dict:
    out = {
        "kind": "header",
        "version": header.version,
        "source": header.source,
        "mode": str(header.mode),
        "geometry": header.geometry.to_json(),
        "pool_pages": header.pool_pages,
        "max_pending": header.max_pending,
    }
    out.update(header.extra)
    return out
