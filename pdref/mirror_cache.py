"""(v4) The fast monitor's transitions for the prefix cache (mirror_apply.py has the rest):
each tests what `apply` tests (cache.py's checks, on the mirror) and returns False, having
changed nothing, where `apply` would refuse; else it changes the mirror as `apply` changes
the state. FastMonitor wraps the other handlers with these (`cache_handlers`), so a trace
before version 4 never passes through the wrappers of its hot events."""

from __future__ import annotations

import attrs

from pdref import cache
from pdref import events as ev
from pdref.rows import IssueRow
from pdref.state import DECODER, LifeRefs


class CacheTransitions:
    """Mixed into FastMonitor beside MirrorTransitions (same attributes, and `_base`: the
    handlers these wrap)."""

    def cache_handlers(self, version: int) -> dict:
        """The handlers that replace the plain ones: reserves and computed events with a hit,
        the cache and evict events; from version 4, every event that may touch a cached page."""
        base = self._base = dict(self._handlers)
        handlers = {ev.Reserve: self._reserve_c, ev.Computed: self._computed_c,
                    ev.Cache: self._cache_e, ev.Evict: self._evict_e}
        if version >= ev.CACHE_VERSION:
            handlers.update({ev.Issue: self._issue_c, IssueRow: self._issue_c,
                             ev.Reuse: self._reuse_c, ev.Fence: self._fence_c})
        assert set(handlers) <= set(base) | {ev.Cache, ev.Evict}
        return handlers

    def _add_refs(self, owner: str, pages, delta: int) -> None:
        pages_of = self.mirror.caches.get(owner)
        for page in pages:
            entry = pages_of[page]
            pages_of[page] = entry._replace(refs=entry.refs + delta)

    def _reserve_c(self, e) -> bool:
        if e.hit is None:
            return self._base[ev.Reserve](e)
        m = self.mirror
        if m.version < ev.CACHE_VERSION or cache.reserve_hit_problem_all(
                m.pool, m.caches, self._requests.values(), e, m.geometry) is not None:
            return False
        if not self._base[ev.Reserve](e):
            return False
        self._requests[e.req].refs = LifeRefs(hits=e.hit)
        self._add_refs(DECODER, e.hit, 1)
        return True

    def _computed_c(self, e) -> bool:
        if e.hit is None:
            return self._base[ev.Computed](e)
        m, life = self.mirror, self._requests.get(e.req)
        if life is None or m.version < ev.CACHE_VERSION or cache.computed_hit_problem(
                m.caches, m.geometry.layers, life.producer, e, m.geometry.page_tokens) is not None:
            return False
        if not self._base[ev.Computed](e):
            return False
        refs = life.refs or cache.NO_REFS
        life.refs = refs._replace(sources=refs.sources + cache.source_entries(
            e.hit, e.tokens[0], m.geometry.page_tokens))
        self._add_refs(life.producer, e.hit, 1)
        return True

    def _issue_c(self, e) -> bool:
        life = self._requests.get(e.req)
        if (life is not None and life.refs is not None and not e.state
                and cache.written_cached(life, e.layers, e.tokens) is not None):
            return False
        return self._base[type(e)](e)

    def _reuse_c(self, e) -> bool:
        life = self._requests.get(e.req)
        if not self._base[ev.Reuse](e):
            return False
        if life.refs is not None and life.refs.sources:
            gone, kept = cache.reused_sources(life, e.tokens, self.mirror.geometry.page_tokens)
            life.refs = life.refs._replace(sources=kept)
            self._add_refs(life.producer, gone, -1)
        return True

    def _fence_c(self, e) -> bool:
        ended = self.mirror.unfenced.get(e.span)
        if not self._base[ev.Fence](e):
            return False
        if ended.pins:
            self._add_refs(ended.producer, ended.pins, -1)
        return True

    def _end_life(self, life) -> None:
        """`apply`'s end of a life: its cached pages are let go (a producer's that its
        unfenced spans read held for them until their fences); the rest as before."""
        refs = life.refs
        if refs is None:
            return super()._end_life(life)
        m = self.mirror
        pins = (cache.span_pins(life, (*life.unfenced, *life.in_flight), m.geometry.page_tokens)
                if m.fences else {})
        self._add_refs(DECODER, refs.hits + refs.published, -1)
        self._add_refs(life.producer, [p for p, _ in refs.sources], -1)
        self._add_refs(life.producer, [p for pages in pins.values() for p in pages], 1)
        if refs.published:
            kept = set(refs.published)
            life.pages = tuple(p for p in life.pages if p not in kept)  # the life is ending
        super()._end_life(life)
        for span_id, pages in pins.items():
            m.unfenced[span_id] = attrs.evolve(m.unfenced[span_id], pins=pages)
        return None

    def _cache_e(self, e) -> bool:
        m, life = self.mirror, self._requests.get(e.req)
        if m.version < ev.CACHE_VERSION or life is None:
            return False
        if e.producer is None:
            problem = cache.decoder_publish_problem(m.geometry, life,
                                                    life.progress_value().landed, e)
        else:
            problem = cache.producer_publish_problem(m.geometry, m.caches, life,
                                                     life.held_value(), e)
        if problem is not None:
            return False
        pt = m.geometry.page_tokens
        entries = cache.new_pages(e.pages, e.tokens[0], pt,
                                  cache.publish_sliding_from(m.geometry, life, e))
        owner, life.refs = cache.published(life.refs or cache.NO_REFS, e, pt)
        m.caches.setdefault(owner, {}).update(entries)
        return True

    def _evict_e(self, e) -> bool:
        m = self.mirror
        if m.version < ev.CACHE_VERSION or cache.evict_problem(
                m.pool, m.caches, self._requests.values(), m.unfenced, e) is not None:
            return False
        if not e.pages:
            return True
        owner = DECODER if e.producer is None else e.producer
        pages_of = m.caches[owner]
        for page in e.pages:
            del pages_of[page]
        if owner == DECODER:
            m.pool = m.pool.give_back(tuple(sorted(e.pages)))
        return True
