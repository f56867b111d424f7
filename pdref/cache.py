"""(v4) The prefix cache's checks and transitions (apply.py calls them; the fast mirror's in
mirror_cache.py use the same checks): pages that several lives share, counted in `refs`;
the decoder's hit at `reserve`, a producer's at `computed`; pages entering a cache (`cache`)
and leaving it (`evict`). Pure: each returns a value or raises the Violation naming its code
(specs/protocol.md gives the order).

Two kinds of cache, one rule set. The decoder's holds pages of its pool (`DECODER`); each
producer's holds pages of its source cache, named by the producer (any page ids). A cached
page is held (its `refs`) by every live life that hit it, published it or copies from it,
and (a producer's page) by every unfenced span of an ended life that reads it; only a page
nobody holds may be evicted. A decoder page is written only before it is cached (CACHE-2),
so no span can write a page another life reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
import immutables

from pdref import events as ev
from pdref.intervals import Range, fmt
from pdref.state import DECODER, CachedPage, LifeRefs, RequestLife, SystemState
from pdref.violations import Violation

NO_REFS = LifeRefs()
_EMPTY: Mapping = immutables.Map()


def need_version_4(version: int, event) -> None:
    """TRACE-1 for a cache field or event in a trace older than version 4."""
    if version < ev.CACHE_VERSION:
        raise Violation("TRACE-1", f"the prefix cache ({event.kind} with pages) needs version "
                        f"4, the header says {version}", event)


def cache_name(owner: str) -> str:
    return "the decoder's prefix cache" if owner == DECODER else f"the cache of producer {owner!r}"


def where_is(pool, lives: Iterable, page) -> str:
    """Where a decoder page that is not cached is: outside the pool, quarantined, free, or
    held by a live slab (whose life may still write it). `lives`: RequestLife or mirror's."""
    if type(page) is not int or not 0 <= page < pool.num_pages:
        return f"outside the pool [0, {pool.num_pages})"
    if pool.quarantined.first_overlap((page, page + 1)) is not None:
        return "quarantined (an unfenced writer may still write it)"
    if pool.free.first_overlap((page, page + 1)) is not None:
        return "free (evicted, or never cached)"
    holder = next((life.req for life in lives if page in life.pages), None)
    return f"held uncached by live request {holder!r}, which may still write it"


def hit_problem(cache: Mapping, pages, first: int, page_tokens: int, where) -> str | None:
    """CACHE-1's sentence for a hit of `pages` on tokens from `first`: each a distinct page
    of `cache` holding the next page of tokens; None when it holds. `where(page)` says where
    an uncached page is."""
    if len(set(pages)) != len(pages):
        return "a page id is listed twice in the hit"
    for i, page in enumerate(pages):
        entry = cache.get(page)
        want = first + i * page_tokens
        if entry is None:
            return f"hit page {page!r} is not cached: {where(page)}"
        if entry.first != want:
            held = (entry.first, entry.first + page_tokens)
            return (f"hit page {page!r} holds tokens {fmt(held)}, not "
                    f"{fmt((want, want + page_tokens))}")
    return None


def reserve_hit_problem(state_pool, caches: Mapping, lives, event: ev.Reserve,
                        page_tokens: int) -> str | None:
    """CACHE-1's sentence for a reserve's `hit` (the decoder's pages of [0, prefix))."""
    if len(event.hit) * page_tokens != event.prefix:
        return (f"hit names {len(event.hit)} pages, the prefix [0, {event.prefix}) is "
                f"{event.prefix // page_tokens}")
    return hit_problem(caches.get(DECODER, _EMPTY), event.hit, 0, page_tokens,
                       lambda page: where_is(state_pool, lives, page))


def reserve_hit_problem_all(pool, caches: Mapping, lives, event: ev.Reserve, geometry):
    """CACHE-1's sentence for a reserve's hit, the window's need included; None if legal."""
    problem = reserve_hit_problem(pool, caches, lives, event, geometry.page_tokens)
    if problem is None:
        problem = hit_window_problem(geometry, caches.get(DECODER, _EMPTY), event.hit,
                                     event.prompt)
    return problem


def computed_hit_problem(caches: Mapping, layers: int, producer: str, event,
                         page_tokens: int) -> str | None:
    """CACHE-1's sentence for a computed's `hit` (its producer's pages of the region)."""
    (l0, l1), (a, b) = event.layers, event.tokens
    if (l0, l1) != (0, layers) or a % page_tokens or b % page_tokens \
            or len(event.hit) * page_tokens != b - a:
        return (f"a producer's hit covers every layer and whole pages: {fmt(event.layers)} x "
                f"{fmt(event.tokens)} with {len(event.hit)} pages of {page_tokens} tokens")
    return hit_problem(caches.get(producer, _EMPTY), event.hit, a, page_tokens,
                       lambda _: f"not in {cache_name(producer)}")


def add_refs(caches: immutables.Map, owner: str, pages, delta: int) -> immutables.Map:
    """The caches with each of `pages` (cached by `owner`) held `delta` more times."""
    if not pages:
        return caches
    with caches.get(owner, _EMPTY).mutate() as cache:
        for page in pages:
            entry = cache[page]
            cache[page] = entry._replace(refs=entry.refs + delta)
        return caches.set(owner, cache.finish())


def new_pages(pages, first: int, page_tokens: int, sliding_from: int) -> list:
    """(page id, CachedPage) of pages newly cached from token `first`, held once; those
    starting below `sliding_from` without the sliding layers' KV."""
    return [(page, CachedPage(first + i * page_tokens, 1, first + i * page_tokens >= sliding_from))
            for i, page in enumerate(pages)]


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


def written_cached(life, layers: Range, tokens: Range) -> Range | None:
    """Tokens of the life's cached (published) pages a KV span over the region would write;
    None when it writes none."""
    refs = life.refs
    if refs is None or not len(refs.cached) or layers[1] <= layers[0]:
        return None
    return refs.cached.first_overlap(tokens)


def check_span_write(life: RequestLife, event) -> None:
    """CACHE-2 at a KV span's issue: it never writes a page the life put into the cache."""
    hit = written_cached(life, event.layers, event.tokens)
    if hit is not None:
        raise Violation("CACHE-2", f"span {fmt(event.layers)} x {fmt(event.tokens)} would "
                        f"write tokens {fmt(hit)} of pages in the decoder's prefix cache", event)


def sliding_from(geometry, life) -> int:
    """The first token from which the life's slab holds every sliding layer's KV (the latest
    window start; its prefix without sliding layers): a page below it lacks some of it."""
    layout = geometry.layout
    starts = [] if layout is None else layout.window_starts(life.prompt, life.prefix,
                                                             geometry.page_tokens)
    return max(starts, default=life.prefix)


def incomplete(geometry, life, landed, tokens: Range) -> str | None:
    """Why the life's slab pages of `tokens` cannot be cached, `landed` (a Coverage) being
    what landed: every full layer must hold all their tokens, every sliding layer those
    inside its window (a page below the window is cached without the sliding layers' KV:
    `CachedPage.sliding`); a linear layer keeps no KV. None when they can."""
    layout = geometry.layout
    if layout is None:
        gap = landed.first_gap((0, geometry.layers), tokens)
        return None if gap is None else f"layer {gap[0]} has not landed tokens {fmt(gap[1])}"
    inside = (max(tokens[0], sliding_from(geometry, life)), tokens[1])
    for kind, need in (("full", tokens), ("sliding", inside)):
        for layers in layout.runs_of(kind):
            gap = landed.first_gap(layers, need)
            if gap is not None:
                return f"layer {gap[0]} has not landed tokens {fmt(gap[1])}"
    return None


def hit_window_problem(geometry, cache: Mapping, pages, prompt: int) -> str | None:
    """CACHE-1's sentence for a decoder hit on a page cached without the sliding layers' KV
    that the hitting life's window needs (its sliding layers attend from the earliest window
    start, `window_range` from token 0); None when every page holds what is needed."""
    layout, pt = geometry.layout, geometry.page_tokens
    starts = [] if layout is None else layout.window_starts(prompt, 0, pt)
    if not starts:
        return None
    need = min(starts)
    for page in pages:
        entry = cache[page]
        if not entry.sliding and entry.first + pt > need:
            return (f"hit page {page!r} holds no sliding layer's KV, and the window of a "
                    f"sliding layer of this request starts at token {need}")
    return None


def decoder_publish_problem(geometry, life, landed, event) -> str | None:
    """CACHE-2's sentence for a `cache` of the decoder: whole pages of the suffix, the slab's
    own, not cached already, complete, and no span of the life in flight or unfenced over
    them."""
    pt, (a, b) = geometry.page_tokens, event.tokens
    if a % pt or b % pt or not (life.prefix <= a and b <= life.prompt):
        return (f"tokens {fmt(event.tokens)} are not whole pages of the suffix "
                f"{fmt((life.prefix, life.prompt))} ({pt} tokens a page)")
    mine = life.pages[(a - life.prefix) // pt:(b - life.prefix) // pt]
    if tuple(event.pages) != tuple(mine):
        return f"pages {list(event.pages)} are not the slab's pages of those tokens, {list(mine)}"
    refs = life.refs or NO_REFS
    hit = refs.cached.first_overlap((a, b))
    if hit is not None:
        return f"tokens {fmt(hit)} are cached already"
    why = incomplete(geometry, life, landed, (a, b))
    if why is not None:
        return why
    for span in (*life.in_flight, *life.unfenced):
        if span.slot is None and span.reads((a, b)):
            what = "in flight" if span in life.in_flight else "unfenced"
            return f"span {span.span!r} {what} writes tokens {fmt(span.tokens)}"
    return None


def producer_publish_problem(geometry, caches: Mapping, life, held, event) -> str | None:
    """CACHE-2's sentence for a `cache` of a producer: its own producer, whole pages of the
    prompt computed on every layer and not reused (`held`, a Coverage), named by pages not
    cached yet."""
    pt, (a, b) = geometry.page_tokens, event.tokens
    if event.producer != life.producer:
        return f"request {life.req!r} computes on producer {life.producer!r}"
    if a % pt or b % pt or b > life.prompt or len(event.pages) * pt != b - a:
        return (f"tokens {fmt(event.tokens)} with {len(event.pages)} pages are not whole pages "
                f"of the prompt [0, {life.prompt}) ({pt} tokens a page)")
    if len(set(event.pages)) != len(event.pages):
        return "a page id is listed twice"
    cache = caches.get(event.producer, _EMPTY)
    old = next((p for p in event.pages if p in cache), None)
    if old is not None:
        return f"page {old!r} is cached already"
    gap = held.first_gap((0, geometry.layers), (a, b))
    if gap is not None:
        return f"layer {gap[0]} has not computed tokens {fmt(gap[1])} (or they were reused)"
    return None


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


def publish_sliding_from(geometry, life, event: ev.Cache) -> int:
    """From which token the pages a `cache` names hold the sliding layers' KV: a producer
    computes every layer of every token; a decoder's slab holds them inside the windows."""
    return 0 if event.producer is not None else sliding_from(geometry, life)


def published(refs: LifeRefs, event: ev.Cache, page_tokens: int) -> tuple[str, LifeRefs]:
    """(the cache's owner, the life's refs) after a legal `cache`: it holds the new pages,
    the decoder's as published (no span may write them), a producer's as copy sources."""
    if event.producer is None:
        return DECODER, refs._replace(published=refs.published + event.pages,
                                      cached=refs.cached.union(event.tokens))
    return event.producer, refs._replace(sources=refs.sources + source_entries(
        event.pages, event.tokens[0], page_tokens))


def source_entries(pages, first: int, page_tokens: int) -> tuple[tuple[object, int], ...]:
    """(page id, first token) of producer pages holding consecutive pages from `first`."""
    return tuple((p, first + i * page_tokens) for i, p in enumerate(pages))


def holder_of(lives: Iterable, unfenced: Mapping, owner: str, page) -> str | None:
    """Who holds cached page `page` of `owner`: a sentence naming a live life or an unfenced
    span; None when nobody does."""
    for life in lives:
        refs = life.refs
        if refs is None:
            continue
        if owner == DECODER and (page in refs.hits or page in refs.published):
            return f"live request {life.req!r} holds it"
        if owner == life.producer and any(p == page for p, _ in refs.sources):
            return f"live request {life.req!r} copies from it"
    for span_id, ended in unfenced.items():
        if ended.producer == owner and page in ended.pins:
            return f"unfenced span {span_id!r} of {ended.req!r} reads it"
    return None


def evict_problem(pool, caches: Mapping, lives, unfenced: Mapping, event) -> str | None:
    """EVICT-1's sentence for an `evict`: distinct pages of that cache that nobody holds."""
    owner = DECODER if event.producer is None else event.producer
    if len(set(event.pages)) != len(event.pages):
        return "a page id is listed twice"
    cache = caches.get(owner, _EMPTY)
    for page in event.pages:
        entry = cache.get(page)
        if entry is None:
            where = where_is(pool, lives, page) if owner == DECODER else "never cached or evicted"
            return f"page {page!r} is not in {cache_name(owner)}: {where}"
        if entry.refs:
            why = holder_of(lives, unfenced, owner, page) or f"{entry.refs} holders"
            return f"page {page!r} of {cache_name(owner)} is held: {why}"
    return None


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


def reused_sources(life, tokens: Range, page_tokens: int) -> tuple[list, tuple]:
    """(the producer pages whose tokens `reuse` frees all of: the life lets go of them, the
    sources it keeps)."""
    a, b = tokens
    gone = [p for p, first in life.refs.sources if a <= first and first + page_tokens <= b]
    kept = tuple((p, f) for p, f in life.refs.sources if not (a <= f and f + page_tokens <= b))
    return gone, kept


def apply_reuse_refs(state: SystemState, life: RequestLife, tokens: Range) -> SystemState:
    """After a legal reuse: the life lets go of the source pages it freed all tokens of."""
    gone, kept = reused_sources(life, tokens, state.geometry.page_tokens)
    if not gone:
        return state
    life = life.replace(refs=life.refs._replace(sources=kept))
    return state.replace(caches=add_refs(state.caches, life.producer, gone, -1),
                         requests=state.requests.set(life.req, life))


def span_pins(life, spans, page_tokens: int) -> dict:
    """span id -> the producer pages (among the life's sources) each span reads: what its
    writer may still read after the life ends, until its fence."""
    pins = {}
    for span in spans:
        pages = tuple(p for p, first in life.refs.sources
                      if span.reads((first, first + page_tokens)))
        if pages:
            pins[span.span] = pages
    return pins


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
