"""A block-hash prefix index: which whole pages of tokens a cache holds, who holds them, and
which to evict (contract v4, docs/prefix-cache.md). Pure Python (no torch): the producer
keys its source cache's pages with it, the decoder its pool's; the page ids are the
owner's (the index only counts and orders them).

- **Keys.** Page k of a token sequence is keyed by `page_keys`: a hash of page k-1's key and
  page k's own tokens (blake2b, deterministic across processes). A key names the whole
  prefix up to the page's end, so a page is found only at its position and only after the
  same tokens before it (KV is rotated by position and attends to everything before it).
  A `KeyChain` keeps a sequence's keys once hashed: a request that waits for room many
  turns is looked up every turn, its pages hashed once (every method takes one in place of
  the tokens).
- **Holders.** Each cached page counts its holders (`acquire`/`release`): the life that put
  it in, every life that hit it, and whatever else still reads it (a producer's unfenced
  span). Only a page nobody holds is *idle* and may be evicted.
- **LRU.** Idle pages are evicted least recently released first. `release` of a run of
  pages queues them tail first, so a prefix's last pages go before its first: evicting a
  leading page leaves the pages after it unreachable (their keys chain through it).
- **Budget.** At most `budget` units; a page costs 1 and whatever its owner keeps beside it
  (`insert`'s `costs`: a hybrid's state snapshot, in pages' worth of bytes), all of it
  evicted together; `room` evicts idle pages to fit new ones.

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
    return KeyChain(tokens, page_tokens, root).upto(len(tokens))


class KeyChain:
    """The keys of a token sequence's whole pages (`page_keys`'s), each page hashed once, the
    first time a key at or after it is asked for: a request keeps its chain while it waits."""

    def __init__(self, tokens: Sequence[int], page_tokens: int, root: bytes = b"") -> None:
        self.tokens, self.page_tokens, self.root = tokens, page_tokens, root
        self._bytes = b""  # the tokens as int64, once a key is asked for
        self._keys: list[bytes] = []

    def upto(self, end: int) -> list[bytes]:
        """The keys of the whole pages of tokens [0, end)."""
        pages = min(end, len(self.tokens)) // self.page_tokens
        if len(self._keys) < pages:
            self._extend(pages)
        return self._keys[:pages]

    def _extend(self, pages: int) -> None:
        if not self._bytes:
            self._bytes = array("q", self.tokens).tobytes()
        size = self.page_tokens * 8  # bytes of a page's int64 tokens
        parent = self._keys[-1] if self._keys else self.root
        for k in range(len(self._keys), pages):
            page = self._bytes[k * size:(k + 1) * size]
            parent = hashlib.blake2b(parent + page, digest_size=KEY_BYTES).digest()
            self._keys.append(parent)


@attrs.frozen
class Entry:
    """A cached page: its key, the first token it holds, its holders' count, the budget's
    units it takes (1, and its owner's extra: a state snapshot kept with it)."""

    key: bytes
    first: int
    refs: int
    cost: int = 1


@attrs.define
class PrefixIndex:
    """Cached whole pages of `page_tokens` tokens, keyed by chained hash, at most `budget`
    units (a page's `cost`). Where a method takes `tokens`, a `KeyChain` of them (`chain`)
    spares hashing them again."""

    page_tokens: int = attrs.field(validator=attrs.validators.gt(0))
    budget: int = attrs.field(validator=attrs.validators.ge(0))
    root: bytes = b""
    _page_of: dict = attrs.field(factory=dict, init=False)  # key -> page id
    _entries: dict = attrs.field(factory=dict, init=False)  # page id -> Entry
    _idle: OrderedDict = attrs.field(factory=OrderedDict, init=False)  # LRU first
    _used: int = attrs.field(default=0, init=False)  # the entries' costs summed

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used(self) -> int:
        """The budget's units the cached pages take (their costs summed)."""
        return self._used

    def chain(self, tokens: Sequence[int] | KeyChain) -> KeyChain:
        """A chain of `tokens`' keys in this index's paging, to keep and pass again (a chain
        given: itself, if made for this paging)."""
        if not isinstance(tokens, KeyChain):
            return KeyChain(tokens, self.page_tokens, self.root)
        if (tokens.page_tokens, tokens.root) != (self.page_tokens, self.root):
            raise ValueError(f"key chain: {tokens.page_tokens}-token pages, root "
                             f"{tokens.root!r}; the index's: {self.page_tokens}, {self.root!r}")
        return tokens

    def keys(self, tokens: Sequence[int] | KeyChain, end: int | None = None) -> list[bytes]:
        """The keys of the whole pages of `tokens` [0, end) (all of them by default)."""
        chain = self.chain(tokens)
        return chain.upto(len(chain.tokens) if end is None else end)

    def lookup(self, tokens: Sequence[int] | KeyChain, start: int = 0,
               limit: int | None = None) -> tuple:
        """The page ids holding the leading whole pages of `tokens` from token `start` (a
        page boundary) on, up to the first page it lacks and within the first `limit`
        tokens: a hit, in token order. It holds nothing: `acquire` the pages to keep them."""
        out = []
        for key in self.keys(tokens, limit)[self._page(start):]:
            page = self._page_of.get(key)
            if page is None:
                break
            out.append(page)
        return tuple(out)

    def _page(self, token: int) -> int:
        if token % self.page_tokens:
            raise ValueError(f"token {token} is not a page boundary ({self.page_tokens} a page)")
        return token // self.page_tokens

    def missing(self, tokens: Sequence[int] | KeyChain, start: int,
                end: int) -> list[tuple[int, int]]:
        """The runs of whole pages in tokens [start, end) (page boundaries) whose keys it
        lacks, as token ranges: what a `cache` may put in."""
        keys = self.keys(tokens, end)
        runs: list[list[int]] = []
        for k in range(self._page(start), self._page(end)):
            if keys[k] in self._page_of:
                continue
            if runs and runs[-1][1] == k:
                runs[-1][1] = k + 1
            else:
                runs.append([k, k + 1])
        return [(a * self.page_tokens, b * self.page_tokens) for a, b in runs]

    def insert(self, tokens: Sequence[int] | KeyChain, span: tuple[int, int], pages: Sequence,
               costs: Sequence[int] | None = None) -> None:
        """Pages `pages` (new ids) now hold tokens `span` (whole pages of `tokens` it lacks),
        held once by whoever put them in, each taking its `costs` units of the budget (1
        each by default). Raises ValueError when that breaks the rules."""
        a, b = span
        first = self._page(a)
        costs = [1] * len(pages) if costs is None else list(costs)
        if len(pages) != self._page(b) - first or len(costs) != len(pages):
            raise ValueError(f"{len(pages)} pages, {len(costs)} costs for tokens [{a}, {b})")
        if any(c < 1 for c in costs):
            raise ValueError(f"costs {costs}: a page costs at least 1")
        if self._used + sum(costs) > self.budget:
            raise ValueError(f"{sum(costs)} more units exceed the budget of {self.budget}")
        keys = self.keys(tokens, b)[first:]
        clash = [p for p in pages if p in self._entries] + [k for k in keys if k in self._page_of]
        if clash or len(set(pages)) != len(pages):
            raise ValueError(f"pages {list(pages)} or their tokens are cached already")
        for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
            self._page_of[key] = page
            self._entries[page] = Entry(key, a + i * self.page_tokens, 1, costs[i])
        self._used += sum(costs)

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

    def idle_count(self, keep: Iterable[Hashable] = ()) -> int:
        """How many idle pages there are, none of `keep` counted."""
        return len(self._idle) - sum(1 for p in set(keep) if p in self._idle)

    def remove(self, pages: Iterable[Hashable]) -> None:
        """These idle pages leave the index (the owner then frees them)."""
        pages = tuple(pages)
        held = [p for p in pages if p not in self._idle]
        if held:
            raise ValueError(f"pages {held} are not idle cached pages")
        for page in pages:
            del self._idle[page]
            self._drop(page)

    def _drop(self, page: Hashable) -> None:
        entry = self._entries.pop(page)
        del self._page_of[entry.key]
        self._used -= entry.cost

    def evict(self, count: int, keep: Iterable[Hashable] = ()) -> tuple:
        """Up to `count` idle pages, least recently used first, none of `keep`, leave the
        index: the page ids an `evict` names (the owner then frees them)."""
        out = self.victims(count, keep)
        self.remove(out)
        return out

    def room(self, want: int) -> tuple[tuple, int]:
        """(pages evicted, how many of `want` new units now fit the budget): idle pages go,
        least recently used first, only as many as `want` needs."""
        over, out = self._used + want - self.budget, []
        for page in self._idle:
            if over <= 0:
                break
            out.append(page)
            over -= self._entries[page].cost
        self.remove(out)
        return tuple(out), max(0, min(want, self.budget - self._used))

    def room_for(self, costs: Sequence[int]) -> tuple[tuple, int]:
        """(pages evicted, how many leading pages of a run costing `costs` now fit): `room`
        for the whole run, then the pages whose costs add up within it."""
        evicted, units = self.room(sum(costs))
        return evicted, sum(1 for total in itertools.accumulate(costs) if total <= units)

    def withdraw(self, pages: Iterable[Hashable]) -> None:
        """Pages held only by whoever put them in leave without an eviction: their entry
        never became part of the owner's record (a `cache` the trace did not take)."""
        pages = tuple(pages)
        held = [p for p in pages if self._entry(p).refs != 1]
        if held:
            raise ValueError(f"pages {held} are held by others than whoever put them in")
        for page in pages:
            self._drop(page)

    def holders(self, page: Hashable) -> int:
        return self._entry(page).refs

    def entries(self) -> dict:
        """page id -> Entry of every cached page (a copy)."""
        return dict(self._entries)

    def idle(self) -> tuple:
        """The idle pages, least recently used first."""
        return tuple(self._idle)
