"""The decoder's page pool: which page ids are free, as an immutable value."""

from __future__ import annotations

from itertools import pairwise

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
    # A run ends wherever the next id is not the next integer.
    cuts = [i for i, (a, b) in enumerate(pairwise(ordered), 1) if b != a + 1]
    bounds = [0, *cuts, len(ordered)]
    return [(ordered[i], ordered[j - 1] + 1) for i, j in pairwise(bounds) if j > i]


@attrs.frozen
class Pool:
    """`num_pages` pages with ids [0, num_pages); `free` holds the ids no live slab holds."""

    num_pages: int
    free: IntervalSet = attrs.field()
    free_pages: int = attrs.field()

    @free.default
    def _all_free(self) -> IntervalSet:
        return IntervalSet.of((0, self.num_pages))

    @free_pages.default
    def _count(self) -> int:
        return self.free.size

    def allocate(self, count: int) -> tuple[Pool, tuple[int, ...]]:
        """Take the `count` lowest free page ids: (new pool, page ids)."""
        if count > self.free_pages:
            raise PoolError(f"{count} pages asked, {self.free_pages} free")
        free, pages = self.free.take_lowest(count)
        return Pool(self.num_pages, free, self.free_pages - count), pages

    def take(self, pages: tuple[int, ...]) -> Pool:
        """Take exactly these page ids; raises PoolError naming the first bad one."""
        if len(pages) > self.free_pages:
            raise PoolError(f"{len(pages)} pages asked, only {self.free_pages} free")
        if len(set(pages)) != len(pages):
            raise PoolError("a page id is listed twice")
        free = self.free
        for run in page_runs(pages):
            if run[0] < 0 or run[1] > self.num_pages:
                raise PoolError(f"page {run[0]} is outside [0, {self.num_pages})")
            gap = free.first_gap(run)
            if gap is not None:
                raise PoolError(f"page {gap[0]} is held by another live slab")
            free = free.difference(run)
        return Pool(self.num_pages, free, self.free_pages - len(pages))

    def give_back(self, pages: tuple[int, ...]) -> Pool:
        free = self.free
        for run in page_runs(pages):
            free = free.union(run)
        return Pool(self.num_pages, free, self.free_pages + len(pages))
