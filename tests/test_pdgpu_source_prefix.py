"""The producer's prefix cache over its source pool: pages are never lost or shared wrongly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdgpu import generate as generate_module
from pdgpu.generate import generate, generate_cached
from pdgpu.serve.models import load_served_model
from pdgpu.source_cache import SourceCache
from pdgpu.source_prefix import SourcePrefix
from pdgpu.state_pool import StateShape
from pdref.geometry import Geometry

PAGE, CHUNK = 2, 2
prompts = st.lists(st.integers(0, 1), min_size=1, max_size=4 * PAGE)


def _source(pages: int) -> SourceCache:
    """A source pool of a model with one linear layer (so pages keep state snapshots), a
    snapshot (68 bytes) worth 3 pages (32 bytes each) of the budget."""
    geometry = Geometry(layers=1, kv_heads=1, head_dim=2, dtype_bytes=4, page_tokens=PAGE)
    return SourceCache(geometry, pages, "cpu", torch.float32,
                       StateShape(1, (1, 1), (1, 1, 16), torch.float32))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(prompts, st.booleans(), st.booleans()), max_size=12),
       st.integers(0, 12))
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


def _accounted(source, cache, open_) -> None:
    assert cache.snapshot_pages == 3
    assert set(cache.snapshots) <= set(cache.index.entries())  # none outlives its page
    used = len(cache.index) + cache.snapshot_pages * len(cache.snapshots)
    assert cache.index.used == used <= cache.index.budget  # each snapshot counted
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


class _Measured(SourcePrefix):
    """generate_cached's cache, its held bytes measured after every change (`seen`)."""

    seen: list = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.page_bytes = self.source.nbytes // self.source.pool.num_pages
        _Measured.seen.append(self)

    def took_state(self, held, end, read) -> None:
        super().took_state(held, end, read)
        self._measure(held)

    def keep(self, tokens, held, start):
        kept = super().keep(tokens, held, start)
        self._measure(held)
        return kept

    def release(self, held) -> None:
        super().release(held)
        self._measure(held)

    def _measure(self, held) -> None:
        """The cache's pages and snapshots, and the prefill's pending snapshots, each within
        the budget's bytes (the tensors' own sizes); no snapshot without its page."""
        def nbytes(states):
            return sum(c.nbytes + r.nbytes for c, r in states)
        limit = self.index.budget * self.page_bytes
        assert len(self.index) * self.page_bytes + nbytes(self.snapshots.values()) <= limit
        assert nbytes(held.states.values()) <= limit
        assert set(self.snapshots) <= set(self.index.entries())


@pytest.mark.parametrize("budget", [8, 20])
def test_a_hybrids_snapshots_count_in_the_budget_and_tokens_stay(monkeypatch, budget):
    """Qwen3.5 through generate's producer cache, pages of 8 tokens, a snapshot worth 5 of
    them: the pages and snapshots held never exceed the budget's bytes (measured after each
    chunk, keep and release), some prompts still hit, every prompt's tokens equal generate's
    without the cache, and at the end every page is free or idle in the cache."""
    _Measured.seen = []
    monkeypatch.setattr(generate_module, "SourcePrefix", _Measured)
    model = load_served_model("tiny-qwen3.5", 0, None, "cpu")
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (48,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 256, (n,), generator=gen).tolist()
               for n in (40, 22, 33, 40)]
    prompts[3] = prompts[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is many times faster on a busy CPU
    try:
        got, computed = generate_cached(model, prompts, [4] * 4, 16, 8, budget)
        assert got == [generate(model, p, 4, 16, 0, 8) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    assert computed < sum(map(len, prompts))
    (cache,) = _Measured.seen
    assert cache.snapshot_pages == 5 and cache.snapshots
    assert all(e.refs == 0 for e in cache.index.entries().values())
    assert cache.source.pool.free_pages + len(cache.index) == cache.source.pool.num_pages
