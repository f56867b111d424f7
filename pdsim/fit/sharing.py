"""How many compute activities ran at once, read from a trace: for fitting `host_cores`.

The activities are what pdsim/core/cores.py shares the host's cores among: producers'
`compute` and `head` stages and the decoder's `decode` steps. A stage's `load` is the mean
number of them running over its span, itself included (1.0: it ran alone). Under processor
sharing on c cores a stage that ran beside load - 1 others took max(1, load / c) times its
time alone; `fit_host_cores` picks the c under which the compute and decode terms, fitted
on durations divided by that factor, explain the measured durations best.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

import numpy as np

ACTIVITIES = ("compute", "head", "decode")  # the stages that run on the host's cores
# Candidate core counts: effective (other work on a shared machine takes a share too), so
# fractional; at least 1 (under 1, an activity alone would run slowed: no longer sharing)
CANDIDATES = tuple(1.0 + 0.125 * i for i in range(41))


class Running:
    """The number of activities running as a step function of time, and its integral."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
        self.times = [t for t, _ in edges]
        self.counts = list(accumulate(d for _, d in edges))  # running on [times[i], next)
        steps = [c * (t1 - t0) for c, t0, t1 in zip(self.counts, self.times, self.times[1:],
                                                    strict=False)]  # the last count is 0
        self.area = [0.0, *accumulate(steps)]  # integral from times[0] to times[i]

    def integral(self, t: float) -> float:
        """Activity-seconds from the first activity's start to `t`."""
        i = bisect_right(self.times, t) - 1
        if i < 0:
            return 0.0
        return self.area[i] + (self.counts[i] * (t - self.times[i]) if i < len(self.counts)
                               else 0.0)

    def load(self, a: float, b: float) -> float:
        """Mean activities running over [a, b] (1.0 for a span of no length)."""
        if b <= a:
            return 1.0
        return max(1.0, (self.integral(b) - self.integral(a)) / (b - a))


def running_of(events) -> Running:
    """The trace's activity spans (every request's, the warm-up's too: it used the cores)."""
    return Running([(e.t, e.end) for e in events
                    if e.kind == "stage" and e.name in ACTIVITIES and e.end > e.t])


def slowdown(load: np.ndarray, cores: float | None) -> np.ndarray:
    """Processor sharing's factor on c cores (None: dedicated devices, 1)."""
    if cores is None:
        return np.ones_like(load)
    return np.maximum(1.0, load / cores)
