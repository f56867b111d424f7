"""The producer's automatic prefix cache: whole pages of its source cache kept after their
request, found again by a later request with the same leading tokens (contract v4,
docs/prefix-cache.md). `pdgpu serve`'s producers and `pdgpu generate` (the reference) use it.

A cached page is a page of the source pool that the index (prefix_index.py) keys by the
chained hash of its tokens; its KV stays where its request computed it. A request:
- `lookup`: the leading cached pages of its prompt, cut to whole chunks (`skip_tokens`), so
  every chunk it computes starts where a run without the cache starts one and sees the same
  bytes before it: its KV and its tokens are bit-exact;
- `open`: holds them, allocates pool pages for the rest (evicting idle cached pages, least
  recently used first, when the pool is short) and loads the hit into the prefill's
  workspace (attention reads the workspace, not the pages);
- `keep`: after its prefill, the whole pages it computed that the index lacks enter it,
  held by the request, within the page budget (idle pages evicted to make room);
- `release`: it lets go of what it held; its pages that did not enter the cache go back.
Every answer is what the trace's events name: the hit's page ids (`computed.hit`), each
kept run's tokens and ids (`cache` with `producer`), the ids evicted (`evict`). Page ids
are pool page ids plus `id_base` (a restarted producer's ids never meet its
predecessor's, still cached in the trace).

With linear layers (Qwen3.5) a page at a hit's possible end keeps the state snapshot there
(`StatePool.read`'s conv and recurrent state of every linear layer); it counts in the page
budget as `snapshot_pages` pages (its bytes over a page's, rounded up) and leaves the cache
with its page. A request's snapshots taken before `keep` are bounded by the budget too
(`took_state`): the cache holds at most `budget` pages' worth of bytes, a prefill at most
that many more until its `keep`.

Where a method takes `tokens`, the request's `KeyChain` (`chain`) may stand for them: kept
while the request waits, its pages are hashed once.

A page may be *unconfirmed*: in the index, but its `cache` not yet recorded by whoever
keeps the trace (the decoder drops the event of a request it already ended). No lookup
returns it until `confirm`; a page whose `cache` was not recorded leaves again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from pdgpu.prefix_index import KeyChain, PrefixIndex
from pdgpu.source_cache import RequestKV, SourceCache


def skip_tokens(pages: int, page_tokens: int, chunk: int, prompt: int) -> int:
    """The prompt tokens a hit of `pages` leading pages lets the prefill skip: whole pages
    and whole chunks (chunk boundaries stay at multiples of `chunk`), and at least one
    prompt token computed (the first output token comes from a computed chunk)."""
    step = math.lcm(chunk, page_tokens)
    return min(pages * page_tokens, prompt - 1) // step * step


@attrs.frozen
class Hit:
    """A lookup's answer: the pool pages of the skipped tokens, and whether a longer hit
    waits only for the confirmation of a page's `cache`."""

    pages: tuple[int, ...]
    waiting: bool = False


@attrs.define
class Held:
    """What a request holds in the cache: pool pages of its hit and of the pages it put in
    (unconfirmed ones included), and its own pages, given back at its end."""

    pages: tuple[int, ...]  # its pool pages, in token order (the hit's first)
    skip: int  # the tokens of its hit: [0, skip) is not computed
    cached: list[int] = attrs.Factory(list)
    own: list[int] = attrs.Factory(list)
    states: dict = attrs.Factory(dict)  # (linear layers) page -> its end's state, until `keep`


@attrs.frozen
class Kept:
    """What `keep` did: the runs of pages put in (tokens, page ids) and the ids evicted."""

    runs: tuple[tuple[tuple[int, int], tuple], ...]
    evicted: tuple


class SourcePrefix:
    """The prefix cache over `source`'s pool: at most `budget` pages."""

    def __init__(self, source: SourceCache, budget: int, chunk: int, id_base: int = 0) -> None:
        self.source, self.chunk, self.id_base = source, chunk, id_base
        self.page_tokens = source.geometry.page_tokens
        self.index = PrefixIndex(self.page_tokens, budget)
        self.unconfirmed: set[int] = set()
        # (a model with linear layers) page -> the state after its last token: a hit ends
        # only at such a page, whose snapshot is then loaded into the request's state slot
        self.keeps_state = source.states is not None
        self.snapshots: dict[int, tuple] = {}
        self.step = math.lcm(chunk, self.page_tokens)  # where a hit may end
        self.snapshot_pages = 0 if source.states is None else \
            -(-source.states.shape.nbytes // (source.nbytes // source.pool.num_pages))

    def chain(self, tokens: Sequence[int]) -> KeyChain:
        """The key chain of a request's tokens, to keep while it waits."""
        return self.index.chain(tokens)

    def ids(self, pages) -> tuple:
        """The trace's ids of pool pages."""
        return tuple(self.id_base + p for p in pages)

    def hit_ids(self, held: Held) -> tuple:
        """The trace's ids of a request's hit pages, in token order."""
        return self.ids(held.pages[:held.skip // self.page_tokens])

    def lookup(self, tokens: Sequence[int] | KeyChain) -> Hit:
        """The leading confirmed cached pages of `tokens`, cut to the tokens they let the
        prefill skip."""
        chain = self.index.chain(tokens)
        prompt = len(chain.tokens)
        found = self.index.lookup(chain, limit=prompt - 1)
        usable = next((i for i, p in enumerate(found) if p in self.unconfirmed), len(found))
        skip = self._skip(found, usable, prompt)
        longer = self._skip(found, len(found), prompt)
        return Hit(found[:skip // self.page_tokens], waiting=longer > skip)

    def _skip(self, found: tuple, usable: int, prompt: int) -> int:
        """The tokens the first `usable` pages of a hit let the prefill skip; with linear
        layers only up to a page that keeps its end's state."""
        skip = skip_tokens(usable, self.page_tokens, self.chunk, prompt)
        while self.keeps_state and skip and found[skip // self.page_tokens - 1] \
                not in self.snapshots:
            skip -= self.step
        return skip

    def took_state(self, held: Held, end: int, read) -> None:
        """(linear layers) After the chunk that ends at token `end`: `read()` (the request's
        state then) is kept for the page ending there, if a hit may end there and the
        request's pages from its hit to there and its snapshots fit the budget (more could
        never all enter the cache: `keep` puts pages in token order)."""
        if self.keeps_state and end % self.step == 0 and end > held.skip:
            cost = (end - held.skip) // self.page_tokens \
                + (len(held.states) + 1) * self.snapshot_pages
            if cost <= self.index.budget:
                held.states[held.pages[end // self.page_tokens - 1]] = read()

    def snapshot(self, held: Held) -> tuple | None:
        """(linear layers) The state at the end of the request's hit, to load; else None."""
        if not (self.keeps_state and held.skip):
            return None
        return self.snapshots[held.pages[held.skip // self.page_tokens - 1]]

    def can_open(self, prompt: int, hit: Hit) -> bool:
        """Whether the pool has, or can free by eviction, the pages the rest needs."""
        idle = self.index.idle_count(hit.pages)
        return self._need(prompt, hit) <= self.source.pool.free_pages + idle

    def _need(self, prompt: int, hit: Hit) -> int:
        return self.source.geometry.pages_for(prompt) - len(hit.pages)

    def open(self, prompt: int, hit: Hit) -> tuple[Held, tuple]:
        """Hold the hit and allocate the rest (idle pages evicted, LRU, if the pool is
        short): (what the request holds, the ids evicted)."""
        self.index.acquire(hit.pages)
        short = self._need(prompt, hit) - self.source.pool.free_pages
        evicted = self._evict(self.index.evict(short)) if short > 0 else ()
        self.source.pool, own = self.source.pool.allocate(self._need(prompt, hit))
        held = Held(hit.pages + own, len(hit.pages) * self.page_tokens, own=list(own))
        return held, evicted

    def _evict(self, pages) -> tuple:
        """Evicted pages back to the pool; their ids."""
        self.source.pool = self.source.pool.give_back(tuple(pages))
        for page in pages:
            self.snapshots.pop(page, None)
        return self.ids(pages)

    def keep(self, tokens: Sequence[int] | KeyChain, held: Held, start: int) -> Kept:
        """After the prefill: the whole pages of [start, prompt) inside whole chunks that
        the index lacks go in, held by the request, unconfirmed, within the budget (a page
        with its snapshot costs 1 + `snapshot_pages`). (A page of a partial last chunk stays
        out: a shorter chunk is another computation, whose bits a later request's whole
        chunk need not reproduce.)"""
        chain = self.index.chain(tokens)
        pt, runs, evicted = self.page_tokens, [], ()
        end = len(chain.tokens) // self.chunk * self.chunk // pt * pt
        for a, b in self.index.missing(chain, start, max(start, end)):
            costs = [1 + self.snapshot_pages * (p in held.states)
                     for p in held.pages[a // pt:b // pt]]
            gone, fit = self.index.room_for(costs)
            evicted += self._evict(gone)
            if not fit:
                continue
            pages = held.pages[a // pt:a // pt + fit]
            self.index.insert(chain, (a, a + fit * pt), pages, costs[:fit])
            self.unconfirmed.update(pages)
            held.cached += pages
            held.own = [p for p in held.own if p not in pages]
            self.snapshots.update((p, held.states[p]) for p in pages if p in held.states)
            runs.append(((a, a + fit * pt), self.ids(pages)))
        held.states.clear()
        return Kept(tuple(runs), evicted)

    def confirm(self, held: Held, recorded: bool) -> None:
        """The trace took (or dropped) the request's `cache`: its pages may be hit now (or
        leave the index and go back with its own)."""
        pages = [p for p in held.cached if p in self.unconfirmed]
        self.unconfirmed.difference_update(pages)
        if not recorded:
            self.index.withdraw(pages)
            for page in pages:
                self.snapshots.pop(page, None)
            held.cached = [p for p in held.cached if p not in pages]
            held.own += pages

    def release(self, held: Held) -> None:
        """The request ends: it lets go of its hit and of the pages it put in; its own pages
        go back to the pool."""
        self.index.release(held.pages[:held.skip // self.page_tokens])  # its hit
        self.index.release(held.cached)
        self.source.pool = self.source.pool.give_back(tuple(held.own))
        held.cached, held.own = [], []


def load_hit(kv: RequestKV, skip: int) -> None:
    """Copy the hit's KV, rows [0, skip) of the request's pages, into its workspace, where
    the chunks after it attend to them (one gather and one copy for every layer)."""
    if skip:
        rows = kv.kv.index_select(2, kv.slots[:skip])  # [L, 2, skip, KVH, D]
        kv.work[:, :, :, :skip] = rows.permute(0, 1, 3, 2, 4)  # [L, 2, KVH, skip, D]
