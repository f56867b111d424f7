"""The checked-ledger core both engines hold: pdref's fast mirror asked in line, each answer
queued for the audit thread, what the audit found raised, the audit drained on every stop.

`pdgpu run`'s Recorder (recorder.py) and `pdgpu serve`'s decoder Ledger (serve/ledger.py)
each hold one `LiveCheck`, differing only in what they pass in:
- `lock`: held around every check and the end-of-run queueing. The Recorder's: the engine's
  thread and the copier's watcher both emit, and the audit must see events in the order the
  mirror saw them. The decoder's loop is one thread: no lock (a no-op context).
- `on_event` / `on_stage`: where an event the mirror accepted goes (the trace), besides the
  audit. After `stop` they alone receive events: the teardown's aborts and fences are
  checked by the mirror alone, so the trace still closes with every life ended.

Live-check cost: every call into the mirror and the queueing of its answer for the audit is
timed on the wall clock (`check_s`, `checks`), only that call inside the window (a wait of the
checking thread for the GIL or the core counts too). No CPU clock: reading a thread's CPU
time is a system call (1.7 us each in a run here), more than the cheapest checks themselves.
The audit's own seconds and lag are apart (`Audit.metrics`).
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext

from pdgpu.audit import BOUND, Audit
from pdref.fast_monitor import FastMonitor
from pdref.monitor import Monitor


class LiveCheck:
    """The fast mirror (`monitor`), the audit thread behind it (`audit`), their cost."""

    def __init__(self, header, on_event, on_stage=None, lock=None, audit_monitor=Monitor,
                 audit_bound: int = BOUND) -> None:
        self.audit = Audit(header, audit_monitor, audit_bound)
        weakref.finalize(self, self.audit.stop)  # a run that raised before it closed
        self._on_event = on_event
        self._on_stage = on_event if on_stage is None else on_stage
        self.monitor = FastMonitor(header, sink=_audited(self._on_event, "emit", self.audit),
                                   stage_sink=_audited(self._on_stage, "stage", self.audit))
        self.lock = nullcontext() if lock is None else lock
        self.check_s = 0.0  # wall seconds in calls into the live check
        self.checks = 0  # calls into the live check
        self.stopped = False  # the run stopped early: the audit is gone

    def ask(self, name: str, *args, audited: bool = False):
        """`name(*args)` on the fast mirror, under the lock, timed as live-check cost;
        `audited`: its answer goes to the audit too. Raises what the audit found first: once
        it refused anything, nothing more is done (until the teardown of a stopped run)."""
        with self.lock:
            start = time.perf_counter()
            try:
                if not self.stopped:
                    self.audit.raise_error()
                answer = getattr(self.monitor, name)(*args)
                if audited and not self.stopped:
                    self.audit.put(name, args, answer, start)
                return answer
            finally:
                self.check_s += time.perf_counter() - start
                self.checks += 1

    def raise_found(self) -> None:
        """What the audit found so far, raised (nothing once the run stopped)."""
        if not self.stopped:
            self.audit.raise_error()

    def found(self, error: BaseException) -> bool:
        """Whether `error` is the audit's finding (an earlier event's), not this call's."""
        return error is self.audit.error

    def close(self) -> None:
        """End of a complete run: LIFE-1 on the mirror at once, then wait (bounded) for the
        audit, which also compares the mirror's whole state with its own; raises what the
        audit found."""
        self.ask("close")
        with self.lock:
            self.audit.put("close", (), None, time.perf_counter())
            self.audit.put("state", (), self.monitor.state, time.perf_counter())
        self.audit.finish()

    def stop(self) -> Exception | None:
        """The run stopped early: the audit checks what was queued before the stop (bounded
        wait) and ends; what it found (None: nothing). From here the mirror alone checks."""
        if not self.stopped:
            self.stopped = True
            self.monitor.sink, self.monitor.stage_sink = self._on_event, self._on_stage
        return self.audit.drain()

    def metrics(self, wall_s: float) -> dict:
        """Live-check cost beside the run's wall, and the audit's seconds and lag."""
        return {"check_s": self.check_s,
                "check_frac": self.check_s / wall_s if wall_s > 0 else 0.0,
                "checks": self.checks, **self.audit.metrics()}


def _audited(sink, name: str, audit: Audit):
    """A mirror's sink: each accepted event to `sink` (the trace) and to the audit as
    `name`. A closure over neither shell: no reference cycle through a Recorder or Ledger,
    so one dropped without `close` is freed at once and its finalizer ends the audit."""
    put, clock = audit.put, time.perf_counter

    def accepted(event) -> None:
        sink(event)
        put(name, (event,), None, clock())

    return accepted
