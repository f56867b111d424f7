"""The engine's line to pdref: every protocol event goes through a live Monitor as it happens.

Protocol events are stamped with the run clock and applied at once (a violation raises and
stops the run). Both the engine's thread and the copier's watcher emit (a span lands when
the watcher sees its last stage complete), so stamping and applying hold one lock: `t` never
decreases in emission order. `stage` events are timed by whoever did the work (a stage is
reported after it ends, with its real start, earlier than events emitted meanwhile), so they
go through `Monitor.stage` (form and per-event rule, not ordered against protocol events),
are kept aside, and are merged into the trace by time when the run ends.
"""

from __future__ import annotations

import itertools
import threading
import time

from pdref import events as ev
from pdref.metrics import run_metrics
from pdref.monitor import Monitor

STAGE_NAMES = ("compute", "head", "blocked", "fill", "gather", "d2h", "h2d")


class Recorder:
    """Clock, live Monitor, span ids, and the events of one run.

    Live-check cost: every call into the Monitor (protocol events, stages, queries) is
    timed on the wall clock, only that call inside the window (so a wait of the checking
    thread for the GIL or the core is counted too). No CPU clock: reading a thread's CPU
    time is a system call (1.7 us each in a run here, 0.16% of an export-only chunked run
    for two per call), more than the cheapest checks themselves."""

    def __init__(self, header: ev.Header) -> None:
        self.header = header
        self.protocol: list = []
        self.stages: list[ev.Stage] = []
        self.monitor = Monitor(header, sink=self.protocol.append, stage_sink=self.stages.append)
        self.check_s = 0.0  # wall seconds in calls into the Monitor
        self.checks = 0  # calls into the Monitor
        self._spans = itertools.count()
        self._lock = threading.RLock()
        self.t0 = time.perf_counter()

    def restart_clock(self) -> None:
        """Put t = 0 here; only before the first event."""
        if self.protocol:
            raise RuntimeError("the clock can only restart before the first event")
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def next_span(self) -> int:
        return next(self._spans)

    def _check(self, call, *args):
        """`call(*args)` into the Monitor, under the lock, timed as live-check cost."""
        with self._lock:
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.check_s += time.perf_counter() - start
                self.checks += 1

    def emit(self, cls, *fields):
        """Stamp, check live and record one protocol event; raises Violation. Stamped under
        the lock: `t` never decreases in emission order."""
        with self._lock:
            event = cls(self.now(), *fields)
            self._check(self.monitor.emit, event)
        return event

    def reserve(self, req: str, prompt: int, prefix: int) -> tuple[int, ...]:
        with self._lock:
            return self._check(self.monitor.reserve, self.now(), req, prompt, prefix)

    def ask(self, query: str, *args) -> bool:
        """A Monitor query (can_issue, can_admit ...)."""
        return self._check(getattr(self.monitor, query), *args)

    def stage(self, req: str, name: str, start: float, end: float, span=None, resource=None,
              tokens=None):
        self._check(self.monitor.stage, ev.Stage(start, req, name, end, span, resource, tokens))

    def free_page_ids(self) -> tuple[int, ...]:
        """The decoder pages the specification's pool holds free (none quarantined)."""
        return self._check(self.monitor.free_page_ids)

    def unfenced(self, req: str) -> tuple:
        """Span ids of `req` whose writer has not been fenced yet."""
        return self._check(self.monitor.unfenced, req)

    def trace(self) -> list:
        """Every event in time order (stable: protocol order is kept among equal times)."""
        return sorted(self.protocol + self.stages, key=lambda e: e.t)


def stage_means(stages: list[ev.Stage]) -> dict:
    """Mean seconds of each copy stage per span, and of a span's whole copy."""
    out = {}
    for name in ("gather", "d2h", "h2d"):
        times = [s.end - s.t for s in stages if s.name == name]
        out[f"{name}_s"] = sum(times) / len(times) if times else None
    spans: dict = {}
    for s in stages:
        if s.span is not None:
            a, b = spans.get(s.span, (s.t, s.end))
            spans[s.span] = (min(a, s.t), max(b, s.end))
    copies = [b - a for a, b in spans.values()]
    out["copy_s"] = sum(copies) / len(copies) if copies else None
    out["compute_s"] = sum(s.end - s.t for s in stages if s.name == "compute")
    out["blocked_s"] = sum(s.end - s.t for s in stages if s.name == "blocked")
    return out


def engine_metrics(rec: Recorder, wall_s: float, extra: dict) -> dict:
    """contract.md's metrics from the trace (pdref.metrics), plus the engine's own figures."""
    metrics = run_metrics(rec.header, rec.trace())
    metrics.update(stage_means(rec.stages))
    metrics.update(extra)
    metrics["wall_s"] = wall_s
    metrics["check_s"] = rec.check_s
    metrics["check_frac"] = rec.check_s / wall_s if wall_s > 0 else 0.0
    metrics["checks"] = rec.checks
    return metrics
