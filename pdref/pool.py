"""The decoder's page pool: which page ids are free, as an immutable value."""

from __future__ import annotations

from itertools import compress, pairwise
from operator import sub

import attrs

from pdref.intervals import IntervalSet


class PoolError(ValueError):
    """A reservation the pool cannot grant; the message says which page or count."""


def page_runs(pages: tuple[int, ...]) -> list[tuple[int, int]]:
    """Sorted page ids coalesced into half-open runs (duplicates must be checked before)."""
    if pages and pages[-1] - pages[0] + 1 == len(pages) and pages == tuple(
        range(pages[0], pages[-1] + 1)
    ):
        return [(pages[0], pages[-1] + 1)]  # the allocator's usual answer: one ascending run
    ordered = sorted(pages)
    # A run ends wherever the next id is not the next integer (steps computed in C: a slab
    # has hundreds of pages).
    steps = map(sub, ordered[1:], ordered)
    cuts = list(compress(range(1, len(ordered)), map((1).__ne__, steps)))
    bounds = [0, *cuts, len(ordered)]
    return [(ordered[i], ordered[j - 1] + 1) for i, j in pairwise(bounds) if j > i]


def _one_run(pages: tuple[int, ...], num_pages: int) -> list[tuple[int, int]] | None:
    """[(a, b)] when `pages` is exactly a, a+1, ..., b-1 inside [0, num_pages) (so in range
    and distinct), else None."""
    if not pages:
        return None
    first = pages[0]
    end = first + len(pages)
    if first < 0 or end > num_pages or pages[-1] != end - 1 or pages != tuple(range(first, end)):
        return None
    return [(first, end)]


# A slab's pages are checked and coalesced into runs when it is reserved and again when it
# goes back. The allocator's tuple is the one the reserve event and the life carry, so the
# runs it was made of are remembered by that tuple's identity (each entry holds the tuple, so
# its id names no other object while the entry lives); an entry goes when its pages go back.
_RUNS: dict[int, tuple[tuple[int, ...], list[tuple[int, int]]]] = {}
_RUNS_MAX = 4096


def _runs_of(pages: tuple[int, ...]) -> list[tuple[int, int]] | None:
    """The runs `pages` was allocated as (ascending, disjoint), or None if not remembered."""
    hit = _RUNS.get(id(pages))
    return None if hit is None else hit[1]


class QuarantineError(PoolError):
    """A reservation that takes a quarantined page (an unfenced writer may still write it)."""


@attrs.frozen
class Pool:
    """`num_pages` pages with ids [0, num_pages): `free` holds the ids no slab holds;
    `quarantined` the pages of ended lives that an unfenced writer may still write (v2).
    A page is free, held by a live slab, or quarantined: never two of these."""

    num_pages: int
    free: IntervalSet = attrs.field()
    free_pages: int = attrs.field()
    quarantined: IntervalSet = IntervalSet()

    @free.default
    def _all_free(self) -> IntervalSet:
        return IntervalSet.of((0, self.num_pages))

    @free_pages.default
    def _count(self) -> int:
        return self.free.size

    def _with(self, free: IntervalSet, free_pages: int, quarantined=None) -> Pool:
        return Pool(self.num_pages, free, free_pages,
                    self.quarantined if quarantined is None else quarantined)

    def allocate(self, count: int) -> tuple[Pool, tuple[int, ...]]:
        """Take the `count` lowest free page ids: (new pool, page ids)."""
        if count > self.free_pages:
            raise PoolError(f"{count} pages asked, {self.free_pages} free")
        free, pages = self.free.take_lowest(count)
        runs, need = [], count
        for a, b in self.free:  # the lowest free ranges, as take_lowest took them
            if need <= 0:
                break
            runs.append((a, a + min(b - a, need)))
            need -= b - a
        if len(_RUNS) >= _RUNS_MAX:
            _RUNS.clear()
        _RUNS[id(pages)] = (pages, runs)
        return self._with(free, self.free_pages - count), pages

    def take(self, pages: tuple[int, ...]) -> Pool:
        """Take exactly these page ids; raises PoolError (QuarantineError for a quarantined
        page) naming the first bad one. Checks: ids in range, no id twice, none quarantined,
        none held by a live slab (so never more than are free)."""
        runs = _runs_of(pages)  # allocated (in range, distinct): only its range is checked
        if runs is not None and runs and (runs[0][0] < 0 or runs[-1][1] > self.num_pages):
            runs = None  # allocated from a larger pool: the generic check names the page
        if runs is None:
            runs = _one_run(pages, self.num_pages)  # one ascending run: no other check needed
        if runs is None:
            if pages and (min(pages) < 0 or max(pages) >= self.num_pages):
                bad = next(p for p in pages if not 0 <= p < self.num_pages)
                raise PoolError(f"page {bad} is outside [0, {self.num_pages})")
            if len(set(pages)) != len(pages):
                raise PoolError("a page id is listed twice")
            runs = page_runs(pages)
        if len(self.quarantined):
            for run in runs:
                hit = self.quarantined.first_overlap(run)
                if hit is not None:
                    raise QuarantineError(f"page {hit[0]} is quarantined: an unfenced writer "
                                          "of an aborted life may still write it")
        free = self.free
        for run in runs:
            gap = free.first_gap(run)
            if gap is not None:
                raise PoolError(f"page {gap[0]} is held by another live slab "
                                f"({self.free_pages} pages free)")
            free = free.difference(run)
        return self._with(free, self.free_pages - len(pages))

    def give_back(self, pages: tuple[int, ...]) -> Pool:
        free = self.free
        known = _RUNS.pop(id(pages), None)
        for run in page_runs(pages) if known is None else known[1]:
            free = free.union(run)
        return self._with(free, self.free_pages + len(pages))

    def quarantine(self, pages: tuple[int, ...]) -> Pool:
        """A held slab's pages become quarantined (its life ended with unfenced writers)."""
        quarantined = self.quarantined
        for run in page_runs(pages):
            quarantined = quarantined.union(run)
        return self._with(self.free, self.free_pages, quarantined)

    def unquarantine(self, pages: tuple[int, ...]) -> Pool:
        """Quarantined pages go back to the free list (their last writer was fenced)."""
        quarantined = self.quarantined
        for run in page_runs(pages):
            quarantined = quarantined.difference(run)
        return self._with(self.free, self.free_pages, quarantined).give_back(pages)

    @property
    def quarantined_pages(self) -> int:
        return self.quarantined.size
