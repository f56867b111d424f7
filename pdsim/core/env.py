"""The discrete-event core: one heap of (time, seq, callback, args); `step()` runs one event.

The sequence counter breaks ties in scheduling order, so equal inputs replay identically.
Processes receive the Env explicitly and schedule their continuations with `at`/`after`.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused(freeze: bool = False) -> Iterator[None]:
    """Pause the cyclic garbage collector. A run allocates millions of short-lived acyclic
    objects (events, spec states) that reference counting frees at once, yet each
    allocation burst triggers collections that rescan the growing heap of kept events: a
    quarter to a third of a run. The few cycles made meanwhile are collected afterwards.
    `freeze`: for a process that exits next, move what is alive out of the collector's
    reach instead (`gc.freeze`), so no pass over every kept event is ever paid; their
    cycles then live until the process ends."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        gc.enable()


class Env:
    """Virtual time and the pending events; nothing else."""

    def __init__(self) -> None:
        self.now = 0.0
        self.steps = 0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0

    def at(self, t: float, callback: Callable, *args) -> None:
        """Run `callback(*args)` at virtual time t (never before now)."""
        if t < self.now:
            raise ValueError(f"cannot schedule at {t}, before now {self.now}")
        heapq.heappush(self._heap, (t, self._seq, callback, args))
        self._seq += 1

    def reserve_seqs(self, count: int) -> int:
        """Set aside `count` sequence numbers for events scheduled later with `at_seq`; the
        first of them. Such an event orders among equal times as if scheduled now."""
        first = self._seq
        self._seq += count
        return first

    def at_seq(self, t: float, seq: int, callback: Callable, *args) -> None:
        """`at` with a sequence number from `reserve_seqs`."""
        if t < self.now:
            raise ValueError(f"cannot schedule at {t}, before now {self.now}")
        heapq.heappush(self._heap, (t, seq, callback, args))

    def take(self, t: float) -> bool:
        """Handle an event due at `t` in place if it would be the next one handled (every
        pending event is later): time moves to `t` and True; else False, nothing changes."""
        heap = self._heap
        if (heap and heap[0][0] <= t) or t < self.now:
            return False
        self.now = t
        self.steps += 1
        return True

    def next_time(self) -> float:
        """When the earliest pending event is due (infinity when none is)."""
        return self._heap[0][0] if self._heap else float("inf")

    def after(self, delay: float, callback: Callable, *args) -> None:
        """Run `callback(*args)` `delay` (>= 0) from now (`at` inlined: a run calls this for
        every compute step)."""
        if delay < 0:
            raise ValueError(f"cannot schedule {delay} s from now: a negative delay")
        heapq.heappush(self._heap, (self.now + delay, self._seq, callback, args))
        self._seq += 1

    def step(self) -> bool:
        """Handle the earliest event; False when none is left."""
        if not self._heap:
            return False
        t, _, callback, args = heapq.heappop(self._heap)
        self.now = t
        self.steps += 1
        callback(*args)
        return True

    def run(self) -> None:
        """Handle events until none is left (`step` inlined: this loop is the hot path)."""
        heap, pop = self._heap, heapq.heappop
        with gc_paused():
            while heap:
                t, _, callback, args = pop(heap)
                self.now = t
                self.steps += 1
                callback(*args)

    @property
    def pending(self) -> int:
        return len(self._heap)
