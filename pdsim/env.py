"""The discrete-event core: one heap of (time, seq, callback, args); `step()` runs one event.

The sequence counter breaks ties in scheduling order, so equal inputs replay identically.
Processes receive the Env explicitly and schedule their continuations with `at`/`after`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


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

    def after(self, delay: float, callback: Callable, *args) -> None:
        self.at(self.now + delay, callback, *args)

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
        while self.step():
            pass

    @property
    def pending(self) -> int:
        return len(self._heap)
