"""Percentiles and means of a run's latencies in memory that stops growing with the run.

`Quantiles` keeps every value (with its count) exactly until it holds `exact_limit` of them
(EXACT_LIMIT: 2**20 values, 16 MiB; every run of 10,000 requests or so stays exact, and its
figures are those of a list sorted at the end). Past that it moves to a sketch with
logarithmic buckets (as DDSketch): a value v > 0 counts in bucket i = ceil(log_g(v)),
g = (1 + a) / (1 - a), which answers for it with 2 g^i / (g + 1). Every value of a bucket lies
within a relative distance `a` (ACCURACY: 0.5 %) of that answer, so a nearest-rank percentile
from the sketch is within a relative `a` of the exact one, and an interpolated percentile
(numpy's linear method) too, since it lies between two such values. Zero is its own bucket
(exact), negative values are mirrored. The buckets a run's values fill are few: about
ln(max / min) / (2 a), a few thousand from a microsecond to a day. Means are running sums.
"""

from __future__ import annotations

import math
from array import array

import numpy as np

EXACT_LIMIT = 1 << 20  # values held exactly before the sketch takes over
ACCURACY = 0.005  # the sketch's relative error bound on any percentile


class Quantiles:
    """Values, each counted some number of times: nearest-rank and interpolated percentiles,
    mean, count."""

    def __init__(self, exact_limit: int = EXACT_LIMIT, accuracy: float = ACCURACY) -> None:
        if not 0 < accuracy < 1:
            raise ValueError(f"accuracy must be in (0, 1), got {accuracy}")
        self.exact_limit = exact_limit
        self.gamma = (1 + accuracy) / (1 - accuracy)
        self.log_gamma = math.log(self.gamma)
        self.values: array | None = array("d")  # None: the sketch holds them
        self.counts = array("q")
        self.count = 0  # values counted, each as many times as its count
        self.total = 0.0  # their sum (for the mean once the sketch holds them)
        self.buckets: dict[int, int] = {}  # bucket index -> count, values > 0
        self.negative: dict[int, int] = {}  # the same of -v, values < 0
        self.zeros = 0

    @property
    def exact(self) -> bool:
        return self.values is not None

    def add(self, value: float, count: int = 1) -> None:
        """Count `value` `count` times."""
        self.count += count
        self.total += value * count
        if self.values is not None:
            self.values.append(value)
            self.counts.append(count)
            if len(self.values) > self.exact_limit:
                self._to_sketch()
            return
        self._bucket(np.array([value]), np.array([count]))

    def extend(self, values, counts) -> None:
        """Count each of `values` its count of `counts` times (arrays of one length)."""
        values = np.asarray(values, dtype=float)
        counts = np.asarray(counts, dtype=np.int64)
        keep = counts > 0  # a value counted 0 times is no value (it never answers a rank)
        values, counts = values[keep], counts[keep]
        self.count += int(counts.sum())
        self.total += float(values @ counts)
        if self.values is not None:
            self.values.extend(values.tolist())
            self.counts.extend(counts.tolist())
            if len(self.values) > self.exact_limit:
                self._to_sketch()
            return
        self._bucket(values, counts)

    def _to_sketch(self) -> None:
        values, counts = np.frombuffer(self.values), np.frombuffer(self.counts, np.int64)
        self.values, self.counts = None, array("q")
        self._bucket(values, counts)

    def _bucket(self, values: np.ndarray, counts: np.ndarray) -> None:
        zero = values == 0
        self.zeros += int(counts[zero].sum())
        for store, sign in ((self.buckets, 1.0), (self.negative, -1.0)):
            mine = sign * values > 0
            if not mine.any():
                continue
            index = np.ceil(np.log(sign * values[mine]) / self.log_gamma).astype(np.int64)
            keys, where = np.unique(index, return_inverse=True)
            sums = np.bincount(where, weights=counts[mine]).astype(np.int64)
            for key, n in zip(keys.tolist(), sums.tolist(), strict=True):
                store[key] = store.get(key, 0) + n

    # -- answers ----------------------------------------------------------------------------

    def percentile(self, q: float) -> float | None:
        """Nearest-rank percentile (q in (0, 100]), as pdgpu serve's; None without values."""
        if not self.count:
            return None
        return self._ranked([max(1, math.ceil(q / 100 * self.count))])[0]

    def interpolated(self, q: float) -> float | None:
        """numpy's default (linear) percentile, counting every value once per its count."""
        if not self.count:
            return None
        if self.values is not None and all(c == 1 for c in self.counts):
            return float(np.percentile(np.frombuffer(self.values), q))
        h = (self.count - 1) * q / 100
        low = math.floor(h)
        a, b = self._ranked([low + 1, min(low + 2, self.count)])
        return a + (h - low) * (b - a)

    def mean(self) -> float | None:
        if not self.count:
            return None
        if self.values is not None and all(c == 1 for c in self.counts):
            return float(np.mean(np.frombuffer(self.values)))
        return self.total / self.count

    def _ranked(self, ranks: list[int]) -> list[float]:
        """The values at 1-based `ranks` of the counted values in order."""
        values, counts = self._table()
        cumulative = np.cumsum(counts)
        return [float(values[np.searchsorted(cumulative, rank)]) for rank in ranks]

    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        """(values in order, their counts): the exact ones, or each bucket's answer."""
        if self.values is not None:
            values = np.frombuffer(self.values)
            order = np.argsort(values, kind="stable")
            return values[order], np.frombuffer(self.counts, np.int64)[order]
        g = self.gamma
        rows = sorted([(-2 * g ** i / (g + 1), n) for i, n in self.negative.items()]
                      + [(0.0, self.zeros)]
                      + [(2 * g ** i / (g + 1), n) for i, n in self.buckets.items()])
        return np.array([v for v, _ in rows]), np.array([n for _, n in rows], dtype=np.int64)
