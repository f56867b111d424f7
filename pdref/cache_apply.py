"""(v4) The prefix cache's transitions of the specification (apply.py calls them): pure,
each returns the new state or raises the Violation naming its code (cache.py has the checks;
specs/protocol.md gives the order)."""

from __future__ import annotations

import attrs
import immutables

from pdref import events as ev
from pdref.cache import (
    NO_REFS,
    computed_hit_problem,
    decoder_publish_problem,
    evict_problem,
    new_pages,
    producer_publish_problem,
    publish_sliding_from,
    published,
    reserve_hit_problem_all,
    reused_sources,
    source_entries,
    span_pins,
    written_cached,
)
from pdref.intervals import Range, fmt
from pdref.state import DECODER, LifeRefs, RequestLife, SystemState
from pdref.violations import Violation

_EMPTY = immutables.Map()


def need_version_4(version: int, event) -> None:
    """TRACE-1 for a cache field or event in a trace older than version 4."""
    if version < ev.CACHE_VERSION:
        raise Violation("TRACE-1", f"the prefix cache ({event.kind} with pages) needs version "
                        f"4, the header says {version}", event)


def add_refs(caches: immutables.Map, owner: str, pages, delta: int) -> immutables.Map:
    """The caches with each of `pages` (cached by `owner`) held `delta` more times."""
    if not pages:
        return caches
    with caches.get(owner, _EMPTY).mutate() as cache:
        for page in pages:
            entry = cache[page]
            cache[page] = entry._replace(refs=entry.refs + delta)
        return caches.set(owner, cache.finish())


def add_pages(caches: immutables.Map, owner: str, entries) -> immutables.Map:
    """The caches with the `new_pages` entries cached by `owner`."""
    with caches.get(owner, _EMPTY).mutate() as cache:
        for page, entry in entries:
            cache[page] = entry
        return caches.set(owner, cache.finish())


def cached_slab_page(state: SystemState, event: ev.Reserve) -> str | None:
    """SLAB-1's sentence for a reserve that takes a cached page into its slab (evict it
    first); None when no page of it is cached."""
    cache = state.caches.get(DECODER, _EMPTY)
    page = next((p for p in event.pages if p in cache), None)
    return None if page is None else (f"page {page} is in the decoder's prefix cache: evict "
                                      "it before a slab takes it")


def reserve_hit(state: SystemState, event: ev.Reserve) -> tuple[immutables.Map, LifeRefs]:
    """CACHE-1 at a reserve with a hit; the caches with its pages held and the life's refs."""
    need_version_4(state.version, event)
    problem = reserve_hit_problem_all(state.pool, state.caches, state.requests.values(), event,
                                      state.geometry)
    if problem is not None:
        raise Violation("CACHE-1", problem, event)
    return add_refs(state.caches, DECODER, event.hit, 1), LifeRefs(hits=event.hit)


def computed_hit(state: SystemState, life: RequestLife, event) -> SystemState:
    """CACHE-1 at a computed with a producer hit; the state with its pages held by the life
    as copy sources (its `computed` coverage is the caller's)."""
    need_version_4(state.version, event)
    pt = state.geometry.page_tokens
    problem = computed_hit_problem(state.caches, state.geometry.layers, life.producer, event, pt)
    if problem is not None:
        raise Violation("CACHE-1", problem, event)
    refs = life.refs or NO_REFS
    sources = refs.sources + source_entries(event.hit, event.tokens[0], pt)
    return state.replace(caches=add_refs(state.caches, life.producer, event.hit, 1),
                         requests=state.requests.set(life.req, life.replace(
                             refs=refs._replace(sources=sources))))


def check_span_write(life: RequestLife, event) -> None:
    """CACHE-2 at a KV span's issue: it never writes a page the life put into the cache."""
    hit = written_cached(life, event.layers, event.tokens)
    if hit is not None:
        raise Violation("CACHE-2", f"span {fmt(event.layers)} x {fmt(event.tokens)} would "
                        f"write tokens {fmt(hit)} of pages in the decoder's prefix cache", event)


def apply_cache(state: SystemState, event: ev.Cache) -> SystemState:
    need_version_4(state.version, event)
    life = state.requests.get(event.req)
    if life is None:
        raise Violation("REQ-1", f"request {event.req!r} is not live", event)
    geometry, refs = state.geometry, life.refs or NO_REFS
    if event.producer is None:
        problem = decoder_publish_problem(geometry, life, life.progress.landed, event)
    else:
        problem = producer_publish_problem(geometry, state.caches, life, life.held, event)
    if problem is not None:
        raise Violation("CACHE-2", problem, event)
    owner, refs = published(refs, event, geometry.page_tokens)
    entries = new_pages(event.pages, event.tokens[0], geometry.page_tokens,
                        publish_sliding_from(geometry, life, event))
    return state.replace(caches=add_pages(state.caches, owner, entries),
                         requests=state.requests.set(life.req, life.replace(refs=refs)))


def apply_evict(state: SystemState, event: ev.Evict) -> SystemState:
    need_version_4(state.version, event)
    problem = evict_problem(state.pool, state.caches, state.requests.values(), state.unfenced,
                            event)
    if problem is not None:
        raise Violation("EVICT-1", problem, event)
    if not event.pages:
        return state
    owner = DECODER if event.producer is None else event.producer
    with state.caches[owner].mutate() as cache:
        for page in event.pages:
            del cache[page]
        caches = state.caches.set(owner, cache.finish())
    pool = state.pool if owner != DECODER else state.pool.give_back(tuple(sorted(event.pages)))
    return state.replace(caches=caches, pool=pool)


def apply_reuse_refs(state: SystemState, life: RequestLife, tokens: Range) -> SystemState:
    """After a legal reuse: the life lets go of the source pages it freed all tokens of."""
    gone, kept = reused_sources(life, tokens, state.geometry.page_tokens)
    if not gone:
        return state
    life = life.replace(refs=life.refs._replace(sources=kept))
    return state.replace(caches=add_refs(state.caches, life.producer, gone, -1),
                         requests=state.requests.set(life.req, life))


def end_refs(state: SystemState, life: RequestLife):
    """At a life's end: (the state with its cached pages let go and the producer pages its
    unfenced spans read held for them, the life with only its uncached pages, the pins)."""
    refs, pt = life.refs, state.geometry.page_tokens
    pins = span_pins(life, (*life.unfenced, *life.in_flight), pt) if state.fences else {}
    caches = add_refs(state.caches, DECODER, refs.hits + refs.published, -1)
    caches = add_refs(caches, life.producer, [p for p, _ in refs.sources], -1)
    caches = add_refs(caches, life.producer, [p for pages in pins.values() for p in pages], 1)
    kept = set(refs.published)
    private = tuple(p for p in life.pages if p not in kept) if kept else life.pages
    return state.replace(caches=caches), life.replace(pages=private), pins


def with_pins(state: SystemState, pins: dict) -> SystemState:
    """The unfenced spans of an ended life holding the producer pages they read."""
    unfenced = state.unfenced
    for span_id, pages in pins.items():
        unfenced = unfenced.set(span_id, attrs.evolve(unfenced[span_id], pins=pages))
    return state.replace(unfenced=unfenced)


def unpin(state: SystemState, ended) -> SystemState:
    """A fenced span of an ended life lets go of the producer pages it read."""
    return state.replace(caches=add_refs(state.caches, ended.producer, ended.pins, -1))
