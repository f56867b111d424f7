"""The producer's prefix cache over its source pool: pages are never lost or shared wrongly."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdgpu.source_cache import SourceCache
from pdgpu.source_prefix import SourcePrefix
from pdgpu.state_pool import StateShape
from pdref.geometry import Geometry

PAGE, CHUNK = 2, 2
prompts = st.lists(st.integers(0, 1), min_size=1, max_size=4 * PAGE)


def _source(pages: int) -> SourceCache:
    """A source pool of a model with one linear layer (so pages keep state snapshots)."""
    geometry = Geometry(layers=1, kv_heads=1, head_dim=2, dtype_bytes=4, page_tokens=PAGE)
    return SourceCache(geometry, pages, "cpu", torch.float32,
                       StateShape(1, (1, 1), (1, 1, 1), torch.float32))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(prompts, st.booleans(), st.booleans()), max_size=12),
       st.integers(0, 6))
def test_every_pool_page_is_free_cached_or_a_live_requests(lives, budget):
    """Requests open and keep pages, two at a time, the word on a `cache` (taken or
    dropped) coming late or at once: no hit names an unconfirmed page or another prompt's
    tokens; every pool page is free, cached, or a live request's own; once all ended
    nothing is held and nothing is lost."""
    source = _source(budget + 2 * 4)
    cache = SourcePrefix(source, budget, CHUNK)
    open_, late = [], []
    for tokens, recorded, later in lives:
        hit = cache.lookup(tokens)
        assert cache.can_open(len(tokens), hit) and not set(hit.pages) & cache.unconfirmed
        held, _ = cache.open(len(tokens), hit)
        assert held.skip < len(tokens) and held.skip % CHUNK == 0
        assert cache.snapshot(held) in (None, ("state", tokens[:held.skip]))
        for end in range(held.skip + CHUNK, len(tokens) + 1, CHUNK):
            cache.took_state(held, end, lambda t=tokens, end=end: ("state", t[:end]))
        for k, page in enumerate(held.pages[:held.skip // PAGE]):
            assert cache.index.lookup(tokens)[k] == page
        cache.keep(tokens, held, held.skip)
        for old in late:  # the word on the previous life's cache, after this one opened
            cache.confirm(*old)
        late = [(held, recorded)] if later else []
        if not later:
            cache.confirm(held, recorded)
        open_.append(held)
        if len(open_) == 2:
            cache.release(open_.pop(0))
        _accounted(source, cache, open_)
    for old in late:
        cache.confirm(*old)
    for held in open_:
        cache.release(held)
    assert all(e.refs == 0 for e in cache.index.entries().values())
    assert source.pool.free_pages + len(cache.index) == source.pool.num_pages
    assert len(cache.index) <= budget


def _accounted(source, cache, open_) -> None:
    assert set(cache.snapshots) <= set(cache.index.entries())  # none outlives its page
    owned = [p for held in open_ for p in held.own]
    cached = set(cache.index.entries())
    assert len(owned) == len(set(owned)) and not cached & set(owned)
    assert source.pool.free_pages + len(cached) + len(owned) == source.pool.num_pages


def test_only_pages_of_whole_chunks_enter_the_cache():
    """A 40-token prompt in chunks of 16 (pages of 8): its partial last chunk's page [32, 40)
    stays out, so a later prompt's hit never reads bits a shorter chunk computed."""
    geometry = Geometry(layers=1, kv_heads=1, head_dim=2, dtype_bytes=4, page_tokens=8)
    cache = SourcePrefix(SourceCache(geometry, 32, "cpu", torch.float32), 16, chunk=16)
    tokens = list(range(100))
    held, _ = cache.open(40, cache.lookup(tokens[:40]))
    kept = cache.keep(tokens[:40], held, 0)
    assert [run for run, _ in kept.runs] == [(0, 32)]
    cache.confirm(held, recorded=True)
    assert len(cache.index.lookup(tokens[:48])) == 4
