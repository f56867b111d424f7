"""How many compute activities ran at once, read from a trace: for fitting `host_cores`.

The activities are what pdsim/core/cores.py shares the host's cores among: producers'
`compute` and `head` stages and the decoder's `decode` steps. A stage's `running` is its
span cut where that number changes: (seconds, activities running, itself included). Under
processor sharing on c cores a stage does min(1, c / n) seconds of its own work per second
while n run, so its time alone is the sum of those (`work_alone`), exactly as the simulator
plays it; `fitting.fit_host_cores` picks the c under which the compute and decode terms,
fitted on those times alone, explain them best.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

import attrs

ACTIVITIES = ("compute", "head", "decode")  # the stages that run on the host's cores
# Candidate core counts: effective (other work on a shared machine takes a share too), so
# fractional; at least 1 (under 1, an activity alone would run slowed: no longer sharing)
CANDIDATES = tuple(1.0 + 0.125 * i for i in range(41))
# Candidate slowdowns by other work (load_factor): 0 .. 2 per share of the host it held (a
# vCPU the hypervisor takes stalls whatever runs on it, so a share can cost more than itself)
SLOWDOWNS = tuple(0.1 * i for i in range(21))


@attrs.frozen
class Sharing:
    """How the engine's activities shared the host: `cores` they shared with the host to
    themselves (None: dedicated devices), and `slowdown`, how much longer each activity
    took per share of the host's cores other work held during its run (measured:
    pdsim/fit/host_load.py). Other work takes cores (fewer for the engine: `run_cores`) and
    slows what still runs (on this VM a busy second vCPU slows the first by about 20%)."""

    cores: float | None
    slowdown: float = 0.0


class Running:
    """The number of activities running, as a step function of time."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
        self.times = [t for t, _ in edges]
        self.counts = list(accumulate(d for _, d in edges))  # running on [times[i], next)

    def segments(self, a: float, b: float) -> tuple[tuple[float, int], ...]:
        """[a, b] cut where the running count changes: (seconds, running, at least 1)."""
        out: list[list] = []
        i = max(bisect_right(self.times, a) - 1, 0)
        while i < len(self.counts) and self.times[i] < b:
            end = self.times[i + 1] if i + 1 < len(self.times) else b
            seconds, count = min(b, end) - max(a, self.times[i]), max(self.counts[i], 1)
            if seconds > 0:
                if out and out[-1][1] == count:
                    out[-1][0] += seconds
                else:
                    out.append([seconds, count])
            i += 1
        return tuple((seconds, count) for seconds, count in out)


def running_of(events) -> Running:
    """The trace's activity spans (every request's, the warm-up's too: it used the cores)."""
    return Running([(e.t, e.end) for e in events
                    if e.kind == "stage" and e.name in ACTIVITIES and e.end > e.t])


def run_cores(cores: float | None, free: float) -> float | None:
    """The cores a run's activities shared: `cores` (the engine's, the host to itself) times
    `free`, the share of the host other work left during that run (measured:
    pdsim/fit/host_load.py; 1 when not measured). None: dedicated devices."""
    return None if cores is None else cores * free


def load_factor(slowdown: float, free: float) -> float:
    """How much longer an activity takes when other work held 1 - `free` of the host."""
    return 1.0 + slowdown * (1.0 - free)


def work_alone(duration: float, running, cores: float | None) -> float:
    """A sample's time alone on c cores (None: dedicated devices, its duration): the part
    of its duration outside its stage (a producer's idle lead) as is, each segment of the
    stage at min(1, c / n) of its length."""
    if cores is None or not running:
        return duration
    shared = sum(seconds * min(1.0, cores / count) for seconds, count in running)
    return duration - sum(seconds for seconds, _ in running) + shared
