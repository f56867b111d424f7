"""The span ids a run has used, held in memory that does not grow with the run.

The specification keeps every span id ever issued, with its request (`spans_used`: an id is
never used twice, REQ-1). A simulator issues its ids from a counter (0, 1, 2 ...), and over a
million requests their owners would be most of what it holds. `UsedSpanIds` keeps integer
ids as ranges of consecutive ids without their owners (one range for a counter's ids: O(1)),
and any other id in a dict with its owner. Membership, all the specification reads of
`spans_used`, is the same; `items()` names the owner of a ranged id as None.
"""

from __future__ import annotations

from bisect import bisect_right


class UsedSpanIds:
    """A set of used span ids (`id in used`, `used[id] = req`), integers as ranges."""

    __slots__ = ("_lo", "_hi", "_others")

    def __init__(self, items=()) -> None:
        self._lo: list[int] = []  # ranges [lo, hi) of integer ids, sorted and disjoint
        self._hi: list[int] = []
        self._others: dict = {}
        for span, req in items:
            self[span] = req

    def __contains__(self, span) -> bool:
        if type(span) is not int:
            return span in self._others
        hi = self._hi
        if not hi or span >= hi[-1]:  # the usual case: a counter's next id, above them all
            return False
        i = bisect_right(self._lo, span) - 1
        return i >= 0 and span < self._hi[i]

    def __setitem__(self, span, req) -> None:
        if type(span) is not int:
            self._others[span] = req
            return
        lo, hi = self._lo, self._hi
        if hi and hi[-1] == span:  # the usual case: the next id of a counter
            hi[-1] = span + 1
            return
        if span in self:
            return
        i = bisect_right(lo, span)
        if i and hi[i - 1] == span:  # joins the range before it (and maybe the next)
            hi[i - 1] = span + 1
        else:
            lo.insert(i, span)
            hi.insert(i, span + 1)
            i += 1
        if i < len(lo) and lo[i] == hi[i - 1]:
            hi[i - 1] = hi[i]
            del lo[i], hi[i]

    def __len__(self) -> int:
        return sum(b - a for a, b in zip(self._lo, self._hi, strict=True)) + len(self._others)

    @property
    def ranges(self) -> int:
        """How many ranges hold the integer ids (the memory this takes, apart from others)."""
        return len(self._lo)

    def items(self):
        """(id, owner) of every id; None: an integer id's owner, not kept."""
        for a, b in zip(self._lo, self._hi, strict=True):
            for span in range(a, b):
                yield span, None
        yield from self._others.items()
