"""Host cores shared by compute activities: processor sharing (profile `[compute] host_cores`).

On one CPU host the producers' prefill chunks and the decoder's steps are processes on the
same few cores (pdgpu serve on this project's 2-core machine); on GPUs each has its own
device and nothing here runs (`Costs.host_cores` None). With `cores` = c and n activities
running, each progresses at min(1, c / n) of its own speed: a 64-token chunk that takes
80 ms alone takes 160 ms beside one decode step on one core.

A span's landing slows the prefill running then: on the 2-vCPU host, in six validation
grids' traces (2026-12-03), prefill chunks beside which the decoder landed spans (chunk and
layer mode: about one 1 MB span a chunk, two with two producers) ran 3..9% slower than
whole mode's, alike alone, beside a decode step and beside the other producer's chunk; the
landing's work (the transport's receive, the write into the slab) is no stage of the trace.
So each landing adds `land_contention` seconds per byte to every running prefill activity's
work (`slow_prefill`); decode steps are not slowed (the decoder does the landing itself,
between its steps).

Exact processor sharing, not an approximation made at an activity's start: each activity
keeps the work it has left (seconds at full speed); whenever the running set changes, the
work done since the last change is taken off everyone at the old rate and the earliest
end is re-timed at the new one. One heap event is pending at a time; one made stale by a
later change is recognised by its version and ignored. A rate frozen at start would leave
an activity that started alone unslowed by everything that joins it later, which is the
very case (a chunk under way when the decoder wakes) this model is for.
"""

from __future__ import annotations

from collections.abc import Callable

# Work left at or under this (seconds) is done: float rounding of "left - elapsed * rate"
DONE_S = 1e-12


class HostCores:
    """The running activities on `cores` cores and the one heap event of the next end."""

    def __init__(self, env, cores: float) -> None:
        self.env, self.cores = env, cores
        self.running: dict[int, list] = {}  # id -> [work left (s), callback, args, prefill]
        self.since = 0.0  # time of the last change of the running set
        self.version = 0  # of the pending end event; older ones are stale
        self.next_id = 0

    def rate(self) -> float:
        """Speed of each running activity, as a fraction of running alone."""
        n = len(self.running)
        return 1.0 if n <= self.cores else self.cores / n

    def start(self, work_s: float, callback: Callable, *args, prefill: bool = False) -> None:
        """Run `work_s` seconds of compute (alone) now; `callback(*args)` when it is done.
        `prefill`: a producer's chunk or head (what a landing slows, `slow_prefill`)."""
        self._advance()
        self.running[self.next_id] = [work_s, callback, args, prefill]
        self.next_id += 1
        self._retime()

    def slow_prefill(self, work_s: float) -> None:
        """Add `work_s` seconds of work to every running prefill activity (a landing now)."""
        if not any(item[3] for item in self.running.values()):
            return
        self._advance()
        for item in self.running.values():
            if item[3]:
                item[0] += work_s
        self._retime()

    def _advance(self) -> None:
        """Take the work done since the last change off every running activity."""
        now = self.env.now
        if self.running and now > self.since:
            done = (now - self.since) * self.rate()
            for item in self.running.values():
                item[0] -= done
        self.since = now

    def _retime(self) -> None:
        self.version += 1
        if self.running:
            left = min(item[0] for item in self.running.values())
            self.env.at(self.env.now + max(left, 0.0) / self.rate(), self._due, self.version)

    def _due(self, version: int) -> None:
        """The earliest end (unless a later change re-timed it): finish what is done."""
        if version != self.version:
            return
        self._advance()
        least = min(item[0] for item in self.running.values())
        done = [key for key, item in self.running.items()
                if item[0] <= max(least, DONE_S)]  # at least the one this event was for
        finished = [self.running.pop(key) for key in done]
        self._retime()
        for _, callback, args, _ in finished:
            callback(*args)
