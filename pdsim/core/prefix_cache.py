"""Automatic prefix caching on both sides (contract v4, docs/prefix-cache.md).

Each side keeps a `PageCache`: whole pages of tokens keyed by what they hold (`page_keys`: a
page of the shared system prompt, else of the request's session), how many live requests
hold each page, and its idle pages (held by none) in least-recently-used order, under a
page budget. `PrefixCaches` plays the rules for a Sim:
- the decoder looks up the leading pages it holds when it reserves a slab: they are the
  life's `prefix` and its reserve's `hit`; it evicts idle pages (LRU) when the pool lacks
  room for a slab; after admission it puts the slab's whole pages whose content it lacks
  into its cache (`cache`), within its budget;
- the producer looks up its own leading pages of the prompt when it takes the life (P
  tokens, a `computed` over [0, P) with `hit`) and computes [P, prompt), the tokens the
  decoder holds included (attention needs their KV on the producer; only their transfer is
  skipped: it sends [prefix, prompt), as pdgpu serve's producer does); a span over its hit
  copies from those pages; after the prefill it puts the pages it computed into its cache
  (`cache` with `producer`);
- a request lets go of its producer pages at its `reuse`, of its decoder pages at its end.
At least one prompt token is always computed (the first output token needs it), so a hit
stops one token short of a whole-page prompt. Output tokens are decoded into the decoder's
own decode cache, not the handoff pool, so a conversation's next turn finds its previous
turns' prompts cached, not their answers.
The monitor (pdref) checks every one of these events: a page evicted while held, a hit on a
page being written or evicted, is a Violation, not a trace.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from pdref import events as ev


def page_keys(request, page_tokens: int, first: int, end: int) -> list:
    """What pages [first, end) of the request hold (their tokens' identity): ("", k) for a
    page inside the system prompt every request shares, else (its session, k)."""
    own = request.session if request.session is not None else request.req
    system = request.system // page_tokens
    return [("", k) if k < system else (own, k) for k in range(first, end)]


class PageCache:
    """One side's cache: content key -> page id, holders per page, idle pages in LRU order."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.page_of: dict = {}  # content key -> page id
        self.key_of: dict = {}  # page id -> content key
        self.refs: dict = {}  # page id -> requests holding it
        self.idle: OrderedDict = OrderedDict()  # pages nobody holds, least recently used first
        self.no_sliding: set = set()  # (decoder) pages cached without the sliding layers' KV

    def __len__(self) -> int:
        return len(self.key_of)

    def lookup(self, keys, sliding_from: int | None = None, page_tokens: int = 0) -> list:
        """The page ids of the leading `keys` it holds (up to the first it lacks); with
        `sliding_from` (the token from which the request's sliding windows need KV), also
        up to the first page cached without sliding KV that reaches past it."""
        out = []
        for k, key in enumerate(keys):
            page = self.page_of.get(key)
            if page is None or (page in self.no_sliding and sliding_from is not None
                                and (k + 1) * page_tokens > sliding_from):
                break
            out.append(page)
        return out

    def hold(self, pages) -> None:
        for page in pages:
            self.refs[page] += 1
            self.idle.pop(page, None)

    def let_go(self, pages) -> None:
        """One holder fewer of each page; idle ones become the most recently used, the run's
        last page first (pdgpu's PrefixIndex.release: a leading page evicted strands the
        pages after it, so it goes last)."""
        for page in reversed(pages):
            self.refs[page] -= 1
            if not self.refs[page]:
                self.idle[page] = None  # the most recently used idle page

    def add(self, keys, pages, no_sliding=()) -> None:
        """New pages holding `keys`, held once (by the request that put them in); those of
        `no_sliding` without the sliding layers' KV."""
        for key, page in zip(keys, pages, strict=True):
            self.page_of[key], self.key_of[page], self.refs[page] = page, key, 1
        self.no_sliding.update(no_sliding)

    def victims(self, count: int, keep=()) -> list:
        """Up to `count` idle pages, least recently used first, none of `keep`."""
        out = []
        for page in self.idle:
            if len(out) == count:
                break
            if page not in keep:
                out.append(page)
        return out

    def drop(self, pages) -> None:
        for page in pages:
            del self.page_of[self.key_of.pop(page)], self.refs[page], self.idle[page]
            self.no_sliding.discard(page)


class PrefixCaches:
    """The decoder's cache and each producer's, played for a Sim (see the module text)."""

    def __init__(self, sim) -> None:
        cfg = sim.cfg
        self.sim, self.emit, self.monitor = sim, sim.emit, sim.monitor
        self.pt, self.layers = cfg.geometry.page_tokens, cfg.geometry.layers
        self.chunk = cfg.chunk
        self.hit_step = math.lcm(cfg.chunk, self.pt)  # a hit ends at a multiple of both
        self.layout = cfg.geometry.layout  # (v3 kinds) sliding windows: what a page holds
        self.decoder = PageCache(cfg.decoder_cache_pages or 0)
        self.producers = {cfg.producer_name(i): PageCache(cfg.producer_cache_pages or 0)
                          for i in range(cfg.producers)}
        self.names = 0  # producer page ids handed out
        # prompt tokens looked up, and found on the decoder / on a producer (vLLM's names)
        self.queries = self.hits = self.producer_hits = 0

    # -- the decoder --------------------------------------------------------------------------

    def decoder_hit(self, request) -> list:
        """The decoder's pages of the request's leading whole pages (one token short), none
        lacking the sliding KV its windows need (contract v4, CACHE-1), up to a multiple of
        the chunk (pdgpu's rule, as the producer's: pdgpu/serve/decoder_prefix.py)."""
        keys = page_keys(request, self.pt, 0, (request.prompt - 1) // self.pt)
        pages = self.decoder.lookup(keys, min(self._window_starts(request.prompt, 0),
                                              default=None), self.pt)
        return self._whole_chunks(pages, 0)

    def _whole_chunks(self, pages: list, start: int) -> list:
        """`pages` from token `start` on, cut to end at a multiple of the chunk: pdgpu's rule
        for exact tokens (a prefill with a hit computes the chunks one without it does)."""
        end = (start + len(pages) * self.pt) // self.hit_step * self.hit_step
        return pages[:max(0, end - start) // self.pt]

    def _window_starts(self, prompt: int, prefix: int) -> list[int]:
        """Where each sliding layer's window starts (pdref.kinds.window_range); [] without
        sliding layers."""
        return [] if self.layout is None else self.layout.window_starts(prompt, prefix, self.pt)

    def room(self, need: int, keep) -> bool:
        """Evict idle decoder pages (LRU, none of `keep`) until `need` pages are free."""
        short = need - self.monitor.free_pages
        if short <= 0:
            return True
        pages = self.decoder.victims(short, keep)
        if pages:
            self._evict(pages)
        return len(pages) == short

    def _evict(self, pages, producer: str | None = None, cache: PageCache | None = None):
        self.emit(ev.Evict(self.sim.env.now, "room", tuple(pages), producer))
        (cache or self.decoder).drop(pages)

    def reserved(self, request, hit) -> None:
        self.decoder.hold(hit)
        self.queries += request.prompt
        self.hits += len(hit) * self.pt

    def publish_decoder(self, job) -> None:
        """After admission: the slab's whole pages inside whole chunks (pdgpu's: a partial
        last chunk's rows need not be the bits a whole chunk gives them) whose content the
        cache lacks go in, in runs of consecutive pages, within the budget (idle pages
        evicted to make room), run by run as pdgpu's DecoderPrefix.publish."""
        request, pt = job.request, self.pt
        first, end = request.prefix // pt, request.prompt // self.chunk * self.chunk // pt
        keys = page_keys(request, pt, first, end)
        # the slab holds sliding KV only inside the windows: pages below go in without it
        sliding_from = max(self._window_starts(request.prompt, request.prefix),
                           default=request.prefix)
        for run in _runs([k for k, key in enumerate(keys) if key not in self.decoder.page_of]):
            fit = self._budget_room(self.decoder, len(run), None)
            if not fit:
                continue
            a, b = run[0], run[0] + fit
            pages = job.slab[a:b]
            self.emit(ev.Cache(self.sim.env.now, job.req, ((first + a) * pt, (first + b) * pt),
                               pages))
            self.decoder.add(keys[a:b], pages, [page for i, page in enumerate(pages)
                                                if (first + a + i) * pt < sliding_from])
            job.decoder_pages += pages

    def _budget_room(self, cache: PageCache, want: int, producer) -> int:
        """How many new pages `cache` may take, idle ones evicted (LRU) to make room."""
        over = len(cache) + want - cache.budget
        if over > 0:
            pages = cache.victims(over)
            if pages:
                self._evict(pages, producer, cache)
        return max(0, min(want, cache.budget - len(cache)))

    def released(self, job) -> None:
        """The life ended: it lets go of its decoder pages (hit and put in)."""
        self.decoder.let_go(job.decoder_pages)

    # -- a producer ---------------------------------------------------------------------------

    def producer_hit(self, name: str, request) -> list:
        """The producer's pages of the request's leading whole pages (one token short), up to
        a multiple of the chunk (pdgpu/source_prefix.py): looked up from token 0 whatever the
        decoder holds, since attention over the rest needs every earlier token's KV here."""
        keys = page_keys(request, self.pt, 0, (request.prompt - 1) // self.pt)
        return self._whole_chunks(self.producers[name].lookup(keys), 0)

    def source_hit(self, name: str, job, pages) -> None:
        """The life loads the producer's `pages` instead of computing them (a `computed`
        with `hit`); spans over them copy from them."""
        self.emit(ev.Computed(self.sim.env.now, job.req, (0, self.layers),
                              (0, len(pages) * self.pt), tuple(pages)))
        self.producers[name].hold(pages)
        job.source_hit = list(pages)
        self.producer_hits += len(pages) * self.pt

    def publish_producer(self, name: str, job, start: int) -> None:
        """After the prefill: the pages it computed from `start` (those the decoder holds
        too), inside the prompt's whole chunks (pdgpu's rule, as the decoder's), that its
        cache lacks go in, run by run within the budget (source_prefix.SourcePrefix.keep)."""
        request, pt, cache = job.request, self.pt, self.producers[name]
        keys = page_keys(request, pt, start // pt, request.prompt // self.chunk * self.chunk // pt)
        for run in _runs([k for k, key in enumerate(keys) if key not in cache.page_of]):
            fit = self._budget_room(cache, len(run), name)
            if not fit:
                continue
            pages = tuple(range(self.names, self.names + fit))
            self.names += fit
            a = start + run[0] * pt
            self.emit(ev.Cache(self.sim.env.now, job.req, (a, a + fit * pt), pages, name))
            cache.add(keys[run[0]:run[0] + fit], pages)
            job.source_held += pages

    def reused(self, name: str, job) -> None:
        """Its `reuse` of the whole prompt: it lets go of its producer pages, its hit's then
        those it put in (SourcePrefix.release)."""
        self.producers[name].let_go(job.source_hit)
        self.producers[name].let_go(job.source_held)
        job.source_hit, job.source_held = [], []


def _runs(indices: list) -> list[list]:
    """Consecutive runs of sorted indices."""
    runs: list[list] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
