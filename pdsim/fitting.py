"""Least-squares fits of the cost model's linear terms (numpy), non-negative by active set."""

from __future__ import annotations

import attrs
import numpy as np

from pdsim.samples import ComputeSample, CopySample


@attrs.frozen
class Fit:
    """Fitted coefficients of one linear model and how well it fits."""

    names: tuple[str, ...]
    values: tuple[float, ...]
    samples: int
    rank: int
    rms: float  # root-mean-square residual, seconds
    mean: float  # mean of the fitted quantity, seconds

    def get(self, name: str) -> float:
        return self.values[self.names.index(name)]

    @property
    def rel_rms(self) -> float:
        return self.rms / self.mean if self.mean > 0 else 0.0


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, int]:
    """Least squares with every coefficient >= 0 (drop the most negative, refit); rank."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = [i for i in range(x.shape[1]) if np.any(x[:, i])]
    rank = int(np.linalg.matrix_rank(xs[:, active])) if active else 0
    while True:
        coef = np.zeros(x.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(xs[:, active], y, rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef / scale, rank
        active.remove(min(negative, key=lambda i: coef[i]))


def fit(names: tuple[str, ...], x: np.ndarray, y: np.ndarray) -> Fit:
    coef, rank = nonneg_lstsq(x, y)
    residual = y - x @ coef
    rms = float(np.sqrt(np.mean(residual**2))) if len(y) else 0.0
    return Fit(names, tuple(float(c) for c in coef), len(y), rank, rms,
               float(np.mean(y)) if len(y) else 0.0)


def fit_compute(samples: list[ComputeSample]) -> Fit:
    """duration = f * (chunk_s * chunks + token_s * n + pair_s * pairs) + contention * overlap."""
    rows = []
    for s in samples:
        a, b = s.tokens
        pairs = (b * (b + 1) - a * (a + 1)) / 2
        rows.append([s.fraction * s.chunks, s.fraction * (b - a), s.fraction * pairs, s.overlap])
    x = np.array(rows, dtype=float).reshape(-1, 4)
    y = np.array([s.duration for s in samples], dtype=float)
    return fit(("chunk_s", "token_s", "pair_s", "contention"), x, y)


def fit_stage(copies: list[CopySample], name: str) -> Fit:
    """duration of stage `name` = intercept + per_byte * bytes."""
    pairs = [(c.nbytes, c.stage(name)) for c in copies if c.stage(name) is not None]
    x = np.array([[1.0, n] for n, _ in pairs], dtype=float).reshape(-1, 2)
    y = np.array([b - a for _, (a, b) in pairs], dtype=float)
    return fit(("intercept_s", "per_byte_s"), x, y)


def link_stage_names(copies: list[CopySample]) -> list[str]:
    seen: dict[str, None] = {}
    for c in copies:
        for name, _, _ in c.stages:
            if name != "gather":
                seen.setdefault(name, None)
    return list(seen)


def is_pipelined(copies: list[CopySample], names: list[str]) -> bool:
    """True when, in most spans, the second link stage starts before the first ends."""
    if len(names) < 2:
        return True
    votes = [c.stage(names[1])[0] < c.stage(names[0])[1] - 1e-12 for c in copies
             if c.stage(names[0]) and c.stage(names[1])]
    return sum(votes) * 2 > len(votes)


def median(values) -> float:
    return float(np.median(values)) if len(values) else 0.0
