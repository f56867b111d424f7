"""(v4) The prefix cache's checks, shared by `apply` (cache_apply.py) and the fast mirror
(mirror_cache.py): pages that several lives share, counted in `refs`; the decoder's hit at
`reserve`, a producer's at `computed`; pages entering a cache (`cache`) and leaving it
(`evict`). Each `*_problem` function returns the sentence of the broken rule or None, and
reads the state or its mirror alike (lives with `.req`, `.pages`, `.refs`, `.producer`).

Two kinds of cache, one rule set. The decoder's holds pages of its pool (`DECODER`); each
producer's holds pages of its source cache, named by the producer (any page ids). A cached
page is held (its `refs`) by every live life that hit it, published it or copies from it,
and (a producer's page) by every unfenced span of an ended life that reads it; only a page
nobody holds may be evicted. A decoder page is written only before it is cached (CACHE-2),
so no span can write a page another life reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import immutables

from pdref import events as ev
from pdref.intervals import Range, fmt
from pdref.state import DECODER, CachedPage, LifeRefs

NO_REFS = LifeRefs()
_EMPTY: Mapping = immutables.Map()


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


def new_pages(pages, first: int, page_tokens: int, sliding_from: int) -> list:
    """(page id, CachedPage) of pages newly cached from token `first`, held once; those
    starting below `sliding_from` without the sliding layers' KV."""
    return [(page, CachedPage(first + i * page_tokens, 1, first + i * page_tokens >= sliding_from))
            for i, page in enumerate(pages)]


def written_cached(life, layers: Range, tokens: Range) -> Range | None:
    """Tokens of the life's cached (published) pages a KV span over the region would write;
    None when it writes none."""
    refs = life.refs
    if refs is None or not len(refs.cached) or layers[1] <= layers[0]:
        return None
    return refs.cached.first_overlap(tokens)


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


def reused_sources(life, tokens: Range, page_tokens: int) -> tuple[list, tuple]:
    """(the producer pages whose tokens `reuse` frees all of: the life lets go of them, the
    sources it keeps)."""
    a, b = tokens
    gone = [p for p, first in life.refs.sources if a <= first and first + page_tokens <= b]
    kept = tuple((p, f) for p, f in life.refs.sources if not (a <= f and f + page_tokens <= b))
    return gone, kept


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

