"""A block-hash prefix index: which whole pages of tokens a cache holds, who holds them, and
which to evict (contract v4, docs/prefix-cache.md). Pure Python (no torch): the producer
keys its source cache's pages with it, the decoder its pool's; the page ids are the
owner's (the index only counts and orders them).

- **Keys.** Page k of a token sequence is keyed by `page_keys`: a hash of page k-1's key and
  page k's own tokens (blake2b, deterministic across processes). A key names the whole
  prefix up to the page's end, so a page is found only at its position and only after the
  same tokens before it (KV is rotated by position and attends to everything before it).
- **Holders.** Each cached page counts its holders (`acquire`/`release`): the life that put
  it in, every life that hit it, and whatever else still reads it (a producer's unfenced
  span). Only a page nobody holds is *idle* and may be evicted.
- **LRU.** Idle pages are evicted least recently released first. `release` of a run of
  pages queues them tail first, so a prefix's last pages go before its first: evicting a
  leading page leaves the pages after it unreachable (their keys chain through it).
- **Budget.** At most `budget` pages; `room` evicts idle pages to fit new ones.

Every operation returns what the contract's events need: `lookup` a hit's page ids in token
order (`reserve.hit`, `computed.hit`), `missing` the whole-page token runs a `cache` names,
`evict`/`room` the page ids an `evict` names.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import attrs

KEY_BYTES = 16


def page_keys(tokens: Sequence[int], page_tokens: int, root: bytes = b"") -> list[bytes]:
    """The chained key of each whole page of `tokens` (a partial last page has none): page
    k's key hashes page k-1's (`root` before page 0: e.g. a model's name) and its tokens."""
    keys, parent = [], root
    for k in range(len(tokens) // page_tokens):
        page = array("q", tokens[k * page_tokens:(k + 1) * page_tokens]).tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


@attrs.frozen
class Entry:
    """A cached page: its key, the first token it holds, its holders' count."""

    key: bytes
    first: int
    refs: int


@attrs.define
class PrefixIndex:
    """Cached whole pages of `page_tokens` tokens, keyed by chained hash, at most `budget`."""

    page_tokens: int = attrs.field(validator=attrs.validators.gt(0))
    budget: int = attrs.field(validator=attrs.validators.ge(0))
    root: bytes = b""
    _page_of: dict = attrs.field(factory=dict, init=False)  # key -> page id
    _entries: dict = attrs.field(factory=dict, init=False)  # page id -> Entry
    _idle: OrderedDict = attrs.field(factory=OrderedDict, init=False)  # LRU first

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        return page_keys(tokens, self.page_tokens, self.root)

    def lookup(self, tokens: Sequence[int], start: int = 0, limit: int | None = None) -> tuple:
        """The page ids holding the leading whole pages of `tokens` from token `start` (a
        page boundary) on, up to the first page it lacks and within the first `limit`
        tokens: a hit, in token order. It holds nothing: `acquire` the pages to keep them."""
        end = len(tokens) if limit is None else min(limit, len(tokens))
        out = []
        for key in self.keys(tokens[:end])[self._page(start):]:
            page = self._page_of.get(key)
            if page is None:
                break
            out.append(page)
        return tuple(out)

    def _page(self, token: int) -> int:
        if token % self.page_tokens:
            raise ValueError(f"token {token} is not a page boundary ({self.page_tokens} a page)")
        return token // self.page_tokens

    def missing(self, tokens: Sequence[int], start: int, end: int) -> list[tuple[int, int]]:
        """The runs of whole pages in tokens [start, end) (page boundaries) whose keys it
        lacks, as token ranges: what a `cache` may put in."""
        keys = self.keys(tokens[:end])
        runs: list[list[int]] = []
        for k in range(self._page(start), self._page(end)):
            if keys[k] in self._page_of:
                continue
            if runs and runs[-1][1] == k:
                runs[-1][1] = k + 1
            else:
                runs.append([k, k + 1])
        return [(a * self.page_tokens, b * self.page_tokens) for a, b in runs]

    def insert(self, tokens: Sequence[int], span: tuple[int, int], pages: Sequence) -> None:
        """Pages `pages` (new ids) now hold tokens `span` (whole pages of `tokens` it lacks),
        held once by whoever put them in. Raises ValueError when that breaks the rules."""
        a, b = span
        first = self._page(a)
        if len(pages) != self._page(b) - first:
            raise ValueError(f"{len(pages)} pages for tokens [{a}, {b})")
        if len(self) + len(pages) > self.budget:
            raise ValueError(f"{len(pages)} more pages exceed the budget of {self.budget}")
        keys = self.keys(tokens[:b])[first:]
        clash = [p for p in pages if p in self._entries] + [k for k in keys if k in self._page_of]
        if clash or len(set(pages)) != len(pages):
            raise ValueError(f"pages {list(pages)} or their tokens are cached already")
        for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
            self._page_of[key] = page
            self._entries[page] = Entry(key, a + i * self.page_tokens, 1)

    def acquire(self, pages: Iterable[Hashable]) -> None:
        """One more holder of each page (a hit): none of them may be evicted now."""
        for page in pages:
            entry = self._entry(page)
            self._entries[page] = attrs.evolve(entry, refs=entry.refs + 1)
            self._idle.pop(page, None)

    def release(self, pages: Sequence[Hashable]) -> None:
        """One holder fewer of each page; those nobody holds become the most recently used
        idle pages, the last page of the run first (evicted before the ones it follows)."""
        for page in reversed(pages):
            entry = self._entry(page)
            if entry.refs == 0:
                raise ValueError(f"page {page!r} is held by nobody")
            self._entries[page] = attrs.evolve(entry, refs=entry.refs - 1)
            if entry.refs == 1:
                self._idle[page] = None

    def _entry(self, page) -> Entry:
        entry = self._entries.get(page)
        if entry is None:
            raise ValueError(f"page {page!r} is not cached")
        return entry

    def victims(self, count: int, keep: Iterable[Hashable] = ()) -> tuple:
        """Up to `count` idle pages, least recently used first, none of `keep`: the pages
        `evict` would take (an owner that records the event first asks this, then `remove`)."""
        keep = set(keep)
        return tuple(itertools.islice((p for p in self._idle if p not in keep), count))

    def remove(self, pages: Iterable[Hashable]) -> None:
        """These idle pages leave the index (the owner then frees them)."""
        pages = tuple(pages)
        held = [p for p in pages if p not in self._idle]
        if held:
            raise ValueError(f"pages {held} are not idle cached pages")
        for page in pages:
            del self._idle[page], self._page_of[self._entries.pop(page).key]

    def evict(self, count: int, keep: Iterable[Hashable] = ()) -> tuple:
        """Up to `count` idle pages, least recently used first, none of `keep`, leave the
        index: the page ids an `evict` names (the owner then frees them)."""
        out = self.victims(count, keep)
        self.remove(out)
        return out

    def room(self, want: int) -> tuple[tuple, int]:
        """(pages evicted, how many of `want` new pages now fit the budget): idle pages go,
        least recently used first, only as many as `want` needs."""
        evicted = self.evict(max(0, len(self) + want - self.budget))
        return evicted, max(0, min(want, self.budget - len(self)))

    def withdraw(self, pages: Iterable[Hashable]) -> None:
        """Pages held only by whoever put them in leave without an eviction: their entry
        never became part of the owner's record (a `cache` the trace did not take)."""
        pages = tuple(pages)
        held = [p for p in pages if self._entry(p).refs != 1]
        if held:
            raise ValueError(f"pages {held} are held by others than whoever put them in")
        for page in pages:
            del self._page_of[self._entries.pop(page).key]

    def holders(self, page: Hashable) -> int:
        return self._entry(page).refs

    def entries(self) -> dict:
        """page id -> Entry of every cached page (a copy)."""
        return dict(self._entries)

    def idle(self) -> tuple:
        """The idle pages, least recently used first."""
        return tuple(self._idle)
