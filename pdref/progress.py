"""Two-dimensional coverage (layers x tokens) and a request's per-layer landing progress.

`Coverage` keeps bands of consecutive layers whose token coverage is identical. A chunk span
(all layers x some tokens) touches one band; a layer span touches one layer; so an update
costs the bands it touches, not the layer count.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

import attrs

from pdref.intervals import IntervalSet, Range, fmt, is_empty

_EMPTY_SET = IntervalSet()
_new = tuple.__new__  # a NamedTuple made without its generated __new__ (one call less)


@attrs.frozen
class Coverage:
    """A set of (layer, token) points over layers [0, num_layers), stored as layer bands."""

    num_layers: int
    # Band i spans layers [starts[i], starts[i+1]) (the last ends at num_layers).
    starts: tuple[int, ...] = (0,)
    sets: tuple[IntervalSet, ...] = (_EMPTY_SET,)

    def _band_end(self, i: int) -> int:
        return self.starts[i + 1] if i + 1 < len(self.starts) else self.num_layers

    def _bands(self, layers: Range):
        """Indices of the bands that hold layers of `layers`."""
        first = bisect_right(self.starts, layers[0]) - 1
        last = bisect_right(self.starts, layers[1] - 1)
        return range(first, last)

    def _split(self, layers: Range) -> Coverage:
        starts, sets = list(self.starts), list(self.sets)
        for cut in layers:
            i = bisect_right(starts, cut) - 1
            if 0 < cut < self.num_layers and starts[i] != cut:
                starts.insert(i + 1, cut)
                sets.insert(i + 1, sets[i])
        return Coverage(self.num_layers, tuple(starts), tuple(sets))

    def _map(self, layers: Range, fn) -> Coverage:
        """Apply fn to the token set of every layer in `layers`, then re-merge equal bands."""
        if layers[0] <= 0 and layers[1] >= self.num_layers:  # every layer: no split needed
            return self._merged(tuple(fn(s) for s in self.sets))
        split = self._split(layers)
        sets = list(split.sets)
        for i in split._bands(layers):
            sets[i] = fn(sets[i])
        return split._merged(tuple(sets))

    def _merged(self, sets: tuple[IntervalSet, ...]) -> Coverage:
        if len(sets) == 1:
            return Coverage(self.num_layers, self.starts, sets)
        starts, merged = [self.starts[0]], [sets[0]]
        for start, s in zip(self.starts[1:], sets[1:], strict=True):
            if s == merged[-1]:
                continue
            starts.append(start)
            merged.append(s)
        return Coverage(self.num_layers, tuple(starts), tuple(merged))

    def union(self, layers: Range, tokens: Range) -> Coverage:
        if layers[1] <= layers[0] or tokens[1] <= tokens[0]:
            return self
        if len(self.sets) == 1 and layers[0] <= 0 and layers[1] >= self.num_layers:
            return _one_band_union(self, tokens[0], tokens[1])
        return self._map(layers, lambda s: s.union(tokens))

    def remove_tokens(self, tokens: Range) -> Coverage:
        """Remove `tokens` on every layer."""
        if is_empty(tokens):
            return self
        return self._merged(tuple(s.difference(tokens) for s in self.sets))

    def first_overlap(self, layers: Range, tokens: Range) -> tuple[int, Range] | None:
        """(layer, tokens) of the first covered point inside the region, or None."""
        if layers[1] <= layers[0] or tokens[1] <= tokens[0]:
            return None
        if len(self.sets) == 1:  # one band: no search
            hit = self.sets[0].first_overlap(tokens)
            return None if hit is None else (max(0, layers[0]), hit)
        for i in self._bands(layers):
            hit = self.sets[i].first_overlap(tokens)
            if hit is not None:
                return max(self.starts[i], layers[0]), hit
        return None

    def first_gap(self, layers: Range, tokens: Range) -> tuple[int, Range] | None:
        """(layer, tokens) of the first point of the region not covered, or None."""
        if layers[1] <= layers[0] or tokens[1] <= tokens[0]:
            return None
        if len(self.sets) == 1:  # one band: no search
            gap = self.sets[0].first_gap(tokens)
            return None if gap is None else (max(0, layers[0]), gap)
        for i in self._bands(layers):
            gap = self.sets[i].first_gap(tokens)
            if gap is not None:
                return max(self.starts[i], layers[0]), gap
        return None

    def covers(self, layers: Range, tokens: Range) -> bool:
        return self.first_gap(layers, tokens) is None

    def tokens_of(self, layer: int) -> IntervalSet:
        return self.sets[bisect_right(self.starts, layer) - 1]


# One-band coverage values recur: chunk k of every request extends [prefix, k * chunk) by
# the same chunk. Shared (immutable) results save two objects per `computed` and `land`. They
# are keyed by the identity of the coverage they extend (hashing its tokens cost more than the
# union): each entry holds that coverage, so its id cannot name another object while the
# entry lives. Chains start from one shared empty coverage per layer count (`empty_coverage`).
_UNIONS: dict[tuple[int, int, int], tuple[Coverage, Coverage]] = {}
_UNIONS_MAX = 8192
_EMPTY: dict[int, Coverage] = {}


def empty_coverage(num_layers: int) -> Coverage:
    """The empty coverage of `num_layers` layers (one shared value per layer count)."""
    found = _EMPTY.get(num_layers)
    if found is None:
        found = _EMPTY[num_layers] = Coverage(num_layers)
    return found


def _one_band_union(cov: Coverage, a: int, b: int) -> Coverage:
    """`cov` (one band, every layer) with tokens [a, b) added on every layer."""
    key = (id(cov), a, b)
    found = _UNIONS.get(key)
    if found is not None:
        return found[1]
    if len(_UNIONS) >= _UNIONS_MAX:
        _UNIONS.clear()
    union = Coverage(cov.num_layers, cov.starts, (cov.sets[0].union((a, b)),))
    _UNIONS[key] = (cov, union)
    return union


class ProgressError(ValueError):
    """A span that cannot be published: out of bounds or overlapping what already landed."""


class _Progress(NamedTuple):
    num_layers: int
    prefix: int
    prompt: int
    landed: Coverage
    finished: bool


class LayerProgress(_Progress):
    """Per-layer landed token intervals of one request inside [prefix, prompt).

    A NamedTuple like the states that hold it (pdref/state.py says why): every land makes one.
    """

    __slots__ = ()

    def __new__(cls, num_layers: int, prefix: int, prompt: int, landed: Coverage | None = None,
                finished: bool = False) -> LayerProgress:
        if landed is None:  # nothing landed yet
            landed = empty_coverage(num_layers)
        return _new(cls, (num_layers, prefix, prompt, landed, finished))

    @property
    def bounds(self) -> Range:
        return (self.prefix, self.prompt)

    def add(self, layers: Range, tokens: Range) -> LayerProgress:
        """Publish a landed span; raises ProgressError if out of bounds or overlapping."""
        num_layers, prefix, prompt, landed, finished = self
        if finished:
            raise ProgressError("progress is finished: nothing more may land")
        (l0, l1), (a, b) = layers, tokens  # `contains` inlined: this runs on every land
        if not ((l1 <= l0 or (0 <= l0 and l1 <= num_layers))
                and (b <= a or (prefix <= a and b <= prompt))):
            raise ProgressError(
                f"span {fmt(layers)} x {fmt(tokens)} is outside "
                f"[0, {num_layers}) x {fmt(self.bounds)}"
            )
        hit = landed.first_overlap(layers, tokens)
        if hit is not None:
            raise ProgressError(f"tokens {fmt(hit[1])} of layer {hit[0]} already landed")
        return _new(LayerProgress, (num_layers, prefix, prompt, landed.union(layers, tokens),
                                    False))

    def missing(self) -> tuple[int, Range] | None:
        """The first (layer, tokens) that has not landed, or None when complete."""
        return self.landed.first_gap((0, self.num_layers), self.bounds)

    def is_complete(self) -> bool:
        return self.missing() is None

    def finish(self) -> LayerProgress:
        """Mark the progress finished (admission); raises ProgressError when incomplete."""
        gap = self.missing()
        if gap is not None:
            raise ProgressError(f"layer {gap[0]} has not landed tokens {fmt(gap[1])}")
        return self._replace(finished=True)

    def finished_now(self) -> LayerProgress:
        """Marked finished (admission) as it is: the caller checked what admission needs
        (every layer of a geometry without kinds; per kind in version 3)."""
        return self._replace(finished=True)
