"""Other work on this host while an engine run is under way, measured, not fitted.

On a shared CPU machine the engine's processes get the cores other processes leave them:
the same point and prompts served twice ran at 21 and 41 tokens/s when another job took a
core during one of them. `HostLoadMonitor` samples /proc while a run is under way (Linux
only) and sums the CPU seconds used by every process outside the run's own process tree
(the engine's decoder, its forkserver and producers) and outside this process, plus the
hypervisor's steal time: the core-seconds the engine could not have. `HostLoad.taken_cores`
is that over the run's wall time. It is an input measured around the run, like the
run's prompts: nothing about the run's outcome (tokens/s, TTFT) goes into it.

A process that ends between two samples loses its last interval (at most `interval_s` of
its CPU); one that starts and ends between two samples is not seen.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import attrs
import numpy as np

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01  # /proc's unit
PROC = Path("/proc")


@attrs.frozen
class HostLoad:
    """What other work took from the host's cores during one run."""

    wall_s: float
    others_cpu_s: float  # CPU seconds of processes outside the run and this process
    steal_s: float  # seconds the hypervisor ran something else on this VM's CPUs
    cores: int  # this host's CPUs

    @property
    def taken_cores(self) -> float:
        """Cores other work held on average over the run."""
        return (self.others_cpu_s + self.steal_s) / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return {**attrs.asdict(self), "taken_cores": self.taken_cores}


def host_load_measurable() -> bool:
    """Whether this host has what the monitor reads (Linux's /proc)."""
    return (PROC / "stat").exists() and (PROC / "uptime").exists()


def steal_ticks() -> int:
    """The host's total steal time so far (the `cpu` line of /proc/stat, 8th value)."""
    with open(PROC / "stat") as f:
        return int(f.readline().split()[8])


def process_table() -> dict[int, tuple[int, int, int]]:
    """Every live process: pid -> (parent pid, CPU ticks used, start time in ticks)."""
    table = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/stat") as f:
                text = f.read()
        except OSError:  # ended since the directory was listed
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]),
                                  int(fields[19]))
    return table


def tree_of(root: int, table: dict[int, tuple[int, int, int]]) -> set[int]:
    """`root` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, ()))
    return tree


def boot_ticks_now() -> float:
    """Ticks since boot (the clock of a process's start time)."""
    with open(PROC / "uptime") as f:
        return float(f.read().split()[0]) / TICK_S


class HostLoadMonitor:
    """Samples the host every `interval_s` from `start` until `stop`; `root` is the pid of
    the run's top process (its tree is the run), set once it is started. `series` holds
    (wall-clock time, others' CPU ticks so far, steal ticks so far) at each sample."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.root: int | None = None
        self.others_ticks = 0
        self.seen: dict[int, int] = {}  # pid -> CPU ticks at its last sample
        self.ours: set[int] = {os.getpid()}  # the run's processes (kept once seen: an
        # orphaned producer still ending is the run's) and this one
        self.series: list[tuple[float, int, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="host-load")

    def start(self) -> HostLoadMonitor:
        self.steal0, self.boot0 = steal_ticks(), boot_ticks_now()
        self.seen = {pid: cpu for pid, (_, cpu, _) in process_table().items()}
        self.series.append((time.time(), 0, 0))
        self.thread.start()
        return self

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self._sample()

    def window(self, a: float, b: float) -> HostLoad:
        """What other work took between wall-clock times a and b (inside the sampled span;
        the counters are interpolated between samples)."""
        times = [t for t, _, _ in self.series]
        if not times[0] <= a < b <= times[-1]:
            raise ValueError(f"host load: window {a:.3f}..{b:.3f} outside the samples "
                             f"{times[0]:.3f}..{times[-1]:.3f}")
        others = np.interp([a, b], times, [o for _, o, _ in self.series])
        steal = np.interp([a, b], times, [s for _, _, s in self.series])
        return HostLoad(b - a, float(others[1] - others[0]) * TICK_S,
                        float(steal[1] - steal[0]) * TICK_S, os.cpu_count() or 1)

    def _loop(self) -> None:
        while not self.done.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        table = process_table()
        if self.root is not None:
            self.ours |= tree_of(self.root, table)
        for pid, (_, cpu, started) in table.items():
            # a pid first seen now: all its time if it started during the run, else none
            before = self.seen.get(pid, 0 if started >= self.boot0 else cpu)
            if pid not in self.ours:
                self.others_ticks += max(0, cpu - before)
            self.seen[pid] = cpu
        self.series.append((time.time(), self.others_ticks, steal_ticks() - self.steal0))
