"""The decoder's automatic prefix cache (contract v4, docs/prefix-cache.md): whole pages of its
landing pool that a request's slab filled, kept after it for a later request with the same
leading tokens, whose KV then never crosses again.

A part of the Decoder (decoder.py) that owns the decoder's `PrefixIndex` (prefix_index.py:
chained page hashes, holders, LRU, a page budget) and what each live request holds in it;
every change to the cache is one call with its pdref event through the Ledger, the event
first (refused: nothing changed):
- `lookup`: the leading cached pages of a prompt, cut as the producer cuts its own hits
  (source_prefix.skip_tokens: whole pages and whole chunks, at least one prompt token
  computed), so every chunk the producer computes starts where a run without the cache
  starts one: the hit's tokens are the request's `prefix` (`reserve.prefix`, `reserve.hit`,
  and the prefix the producer is told), and its KV lies in those pages already;
- `room`: when the pool lacks the pages of a slab, idle cached pages go (`evict`, least
  recently used first, never the hit's);
- `publish`: after admission, the slab's whole pages the index lacks go in (`cache`),
  within the budget (idle pages evicted to make room); only pages inside the request's whole
  chunks (a partial last chunk is computed as a shorter GEMM, whose rows need not be the
  bits a later request's whole chunk gives them);
- sliding layers (Gemma 3): a slab holds a sliding layer's KV only inside its window, so a
  page below the window is cached without it (pdref's `CachedPage.sliding` false) and a
  lookup stops at the first such page that a request's own windows reach into (CACHE-1);
- `let_go`: a life that ended (released or aborted) no longer holds its pages;
- `drain`: at the end of the run every cached page is evicted, so the trace ends with every
  page of the pool free.
A span that failed or landed wrong bytes never makes a page cached: such a life is never
admitted (ADM-1), and only an admitted life publishes.
`lookup` and `publish` take a request's tokens or its `KeyChain` (`chain`): the decoder keeps
a waiting request's chain, so each of its pages is hashed once however many turns it waits.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdgpu.prefix_index import KeyChain, PrefixIndex
from pdgpu.serve.ledger import Ledger
from pdgpu.source_prefix import skip_tokens


class DecoderPrefix:
    """The decoder's prefix cache over its pool (see the module docstring)."""

    def __init__(self, ledger: Ledger, chunk: int, budget: int) -> None:
        self.ledger, self.chunk = ledger, chunk
        self.page_tokens = ledger.geometry.page_tokens
        self.index = PrefixIndex(self.page_tokens, budget)
        self.layout = ledger.geometry.layout  # sliding windows: what a slab page holds
        self.no_sliding: set[int] = set()  # cached pages without the sliding layers' KV
        self.held: dict[str, list[int]] = {}  # req -> pages its live life holds
        ledger.on_end = self.let_go  # a life's release or abort lets go of its pages
        # prompt tokens looked up at reserve, and found cached (vLLM's counters)
        self.queries = self.hits = 0

    def chain(self, tokens: Sequence[int]) -> KeyChain:
        """The key chain of a request's prompt, to keep while it waits."""
        return self.index.chain(tokens)

    def lookup(self, tokens: Sequence[int] | KeyChain) -> tuple[int, ...]:
        """The cached pages of `tokens`' leading whole chunks (see the module docstring),
        in token order; held by nobody yet."""
        chain = self.index.chain(tokens)
        prompt = len(chain.tokens)
        found = self.index.lookup(chain, limit=prompt - 1)
        need = min(self._window_starts(prompt, 0), default=None)
        usable = next((k for k, page in enumerate(found) if page in self.no_sliding
                       and (k + 1) * self.page_tokens > need), len(found))
        skip = skip_tokens(usable, self.page_tokens, self.chunk, prompt)
        return found[:skip // self.page_tokens]

    def _window_starts(self, prompt: int, prefix: int) -> list[int]:
        """Where each sliding layer's window starts (pdref's); [] without sliding layers."""
        if self.layout is None:
            return []
        return self.layout.window_starts(prompt, prefix, self.page_tokens)

    def room(self, req: str, pages: int, keep: Sequence[int]) -> bool:
        """Evict idle cached pages, least recently used first and none of `keep`, until the
        pool has `pages` free pages; whether it has them."""
        short = pages - self.ledger.free_pages()
        if short > 0:
            self._evict(req, short, keep)
        return short <= 0 or pages <= self.ledger.free_pages()

    def _evict(self, req: str, count: int, keep: Sequence[int] = ()) -> None:
        """Up to `count` idle pages out (the event first, then the index)."""
        pages = self.index.victims(count, keep)
        if pages:
            self.ledger.evict(req, list(pages))
            self.index.remove(pages)
            self.no_sliding.difference_update(pages)

    def reserved(self, req: str, prompt: int, hit: tuple[int, ...]) -> None:
        """`req`'s reserve named `hit`: it holds those pages until its life ends."""
        self.index.acquire(hit)
        self.held[req] = list(hit)
        self.queries += prompt
        self.hits += len(hit) * self.page_tokens

    def publish(self, req: str, tokens: Sequence[int] | KeyChain, prefix: int,
                slab: Sequence[int]) -> None:
        """After `req`'s admission: its slab's (`slab`: the pages of [prefix, prompt)) whole
        pages inside whole chunks that the index lacks go in, within the budget."""
        chain, pt = self.index.chain(tokens), self.page_tokens
        prompt = len(chain.tokens)
        end = prompt // self.chunk * self.chunk // pt * pt
        # the slab holds every sliding layer's KV from the latest window start on
        sliding_from = max(self._window_starts(prompt, prefix), default=prefix)
        for a, b in self.index.missing(chain, prefix, end) if end > prefix else ():
            fit = self._fit((b - a) // pt, req)
            if fit:
                pages = tuple(slab[(a - prefix) // pt:(a - prefix) // pt + fit])
                self.ledger.cache(req, (a, a + fit * pt), pages)
                self.index.insert(chain, (a, a + fit * pt), pages)
                self.no_sliding.update(p for i, p in enumerate(pages) if a + i * pt < sliding_from)
                self.held[req] += pages

    def _fit(self, want: int, req: str) -> int:
        """How many of `want` new pages the budget takes, idle pages evicted for them."""
        over = len(self.index) + want - self.index.budget
        if over > 0:
            self._evict(req, over)
        return max(0, min(want, self.index.budget - len(self.index)))

    def let_go(self, req: str) -> None:
        """`req`'s life ended: it holds none of its pages any more."""
        self.index.release(self.held.pop(req, ()))

    def drain(self) -> None:
        """The run's end: every cached page (idle now: no life is left) is evicted."""
        self._evict("end", len(self.index))
