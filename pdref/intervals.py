"""Half-open integer ranges and immutable sets of disjoint ranges.

An `IntervalSet` stores sorted, disjoint, non-adjacent `(a, b)` pairs, so a span lands in
O(log n) search plus a copy of the (short) tuple: adjacent spans merge, and a prompt sent
in order stays a single interval however long it is.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import attrs

Range = tuple[int, int]
EMPTY: Range = (0, 0)


def length(r: Range) -> int:
    return r[1] - r[0] if r[1] > r[0] else 0


def is_empty(r: Range) -> bool:
    return r[1] <= r[0]


def overlaps(x: Range, y: Range) -> bool:
    """True when two non-empty ranges share a point."""
    return x[0] < y[1] and y[0] < x[1] and x[0] < x[1] and y[0] < y[1]


def contains(outer: Range, inner: Range) -> bool:
    """True when `inner` lies inside `outer` (an empty range lies inside anything)."""
    return inner[1] <= inner[0] or (outer[0] <= inner[0] and inner[1] <= outer[1])


def intersect(x: Range, y: Range) -> Range:
    a, b = max(x[0], y[0]), min(x[1], y[1])
    return (a, b) if a < b else EMPTY


def fmt(r: Range) -> str:
    return f"[{r[0]}, {r[1]})"


@attrs.frozen
class IntervalSet:
    """A set of integers stored as sorted, disjoint, non-adjacent half-open ranges."""

    starts: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()

    @classmethod
    def of(cls, *ranges: Range) -> IntervalSet:
        result = cls()
        for r in ranges:
            result = result.union(r)
        return result

    def __iter__(self):
        return zip(self.starts, self.ends, strict=True)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self)

    def first_overlap(self, r: Range) -> Range | None:
        """The first stored range that overlaps `r`, or None."""
        if r[1] <= r[0]:
            return None
        i = bisect_right(self.ends, r[0])
        if i < len(self.starts) and self.starts[i] < r[1]:
            return (max(self.starts[i], r[0]), min(self.ends[i], r[1]))
        return None

    def covers(self, r: Range) -> bool:
        """True when every point of `r` is in the set."""
        if r[1] <= r[0]:
            return True
        i = bisect_right(self.ends, r[0])
        return i < len(self.starts) and self.starts[i] <= r[0] and r[1] <= self.ends[i]

    def first_gap(self, r: Range) -> Range | None:
        """The first sub-range of `r` that is not in the set, or None when `r` is covered."""
        if r[1] <= r[0]:
            return None
        i = bisect_right(self.ends, r[0])
        if i >= len(self.starts) or self.starts[i] > r[0]:
            end = self.starts[i] if i < len(self.starts) else r[1]
            return (r[0], min(end, r[1]))
        if self.ends[i] >= r[1]:
            return None
        nxt = self.starts[i + 1] if i + 1 < len(self.starts) else r[1]
        return (self.ends[i], min(nxt, r[1]))

    def union(self, r: Range) -> IntervalSet:
        """The set with `r` added; overlap and adjacency merge."""
        a, b = r
        if b <= a:
            return self
        starts, ends = self.starts, self.ends
        if not starts:
            return IntervalSet((a,), (b,))
        if a >= ends[-1]:  # the common case: spans and chunks arrive in token order
            if a > ends[-1]:
                return IntervalSet(starts + (a,), ends + (b,))
            return IntervalSet(starts, ends[:-1] + (b,))  # adjacent: the last range grows
        lo = bisect_left(self.ends, a)  # first range ending at or after a (adjacent merges)
        hi = bisect_right(self.starts, b)  # ranges starting at or before b (adjacent merges)
        if lo < hi:
            a = min(a, self.starts[lo])
            b = max(b, self.ends[hi - 1])
        return IntervalSet(
            self.starts[:lo] + (a,) + self.starts[hi:], self.ends[:lo] + (b,) + self.ends[hi:]
        )

    def difference(self, r: Range) -> IntervalSet:
        """The set with every point of `r` removed."""
        a, b = r
        if b <= a:
            return self
        lo = bisect_right(self.ends, a)
        hi = bisect_left(self.starts, b)
        if lo >= hi:
            return self
        starts, ends = [], []
        if self.starts[lo] < a:
            starts.append(self.starts[lo])
            ends.append(a)
        if self.ends[hi - 1] > b:
            starts.append(b)
            ends.append(self.ends[hi - 1])
        return IntervalSet(
            self.starts[:lo] + tuple(starts) + self.starts[hi:],
            self.ends[:lo] + tuple(ends) + self.ends[hi:],
        )

    def take_lowest(self, count: int) -> tuple[IntervalSet, tuple[int, ...]]:
        """Remove the `count` lowest points; returns (rest, points). Caller checks size."""
        starts, ends = self.starts, self.ends
        if starts and ends[0] - starts[0] > count:  # the usual case: the lowest range has more
            a = starts[0]
            return IntervalSet((a + count,) + starts[1:], ends), tuple(range(a, a + count))
        taken: list[int] = []
        need, i = count, 0
        while need > 0:
            a, b = starts[i], ends[i]
            if b - a > need:  # the last range taken from: its rest stays
                taken.extend(range(a, a + need))
                return IntervalSet((a + need,) + starts[i + 1:], ends[i:]), tuple(taken)
            taken.extend(range(a, b))
            need -= b - a
            i += 1
        return IntervalSet(starts[i:], ends[i:]), tuple(taken)
