"""The engine's line to pdref: every protocol event is checked as it happens.

Protocol events are stamped with the run clock and checked at once by pdref's `FastMonitor`
(the mutable mirror: same verdicts as `Monitor`, about twice as fast), which also answers
every query the engine decides with (can_issue, can_admit, free pages ...); a violation
raises and stops the run. Behind it, off the critical path, the audit thread (audit.py)
replays every accepted event and every answer into the specification's `Monitor`; what it
refuses, or answers differently, is raised at the engine's next call into pdref (at most
`audit.BOUND` events later) or at the end of the run, which waits for the audit.
Both the engine's thread and the copier's watcher emit (a span lands when the watcher sees
its last stage complete), so stamping, checking and queueing hold one lock: `t` never
decreases in emission order, and the audit sees what the mirror saw, in its order.
`stage` events are timed by whoever did the work (a stage is reported after it ends, with
its real start, earlier than events emitted meanwhile), so they go through `stage` (form and
per-event rule, not ordered against protocol events), are kept aside, and are merged into
the trace by time when the run ends.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref

from pdgpu.audit import BOUND, Audit
from pdref import events as ev
from pdref.fast_monitor import FastMonitor
from pdref.metrics import run_metrics
from pdref.monitor import Monitor

STAGE_NAMES = ("compute", "head", "blocked", "fill", "gather", "d2h", "h2d")


class Recorder:
    """Clock, live checks (fast mirror in line, full Monitor behind), span ids, the events.

    Live-check cost: every call into the fast mirror (protocol events, stages, queries) and
    the queueing of it for the audit is timed on the wall clock, only that call inside the
    window (so a wait of the checking thread for the GIL or the core is counted too). No CPU
    clock: reading a thread's CPU time is a system call (1.7 us each in a run here, 0.16% of
    an export-only chunked run for two per call), more than the cheapest checks themselves.
    The audit's own seconds and lag are reported apart (Audit.metrics)."""

    def __init__(self, header: ev.Header, audit_monitor=Monitor, audit_bound: int = BOUND) -> None:
        self.header = header
        self.protocol: list = []
        self.stages: list[ev.Stage] = []
        self.audit = Audit(header, audit_monitor, audit_bound)
        weakref.finalize(self, self.audit.stop)  # a run that raised never closes
        accepted, staged = _sinks(self.protocol, self.stages, self.audit)
        self.monitor = FastMonitor(header, sink=accepted, stage_sink=staged)
        self.check_s = 0.0  # wall seconds in calls into the live check
        self.checks = 0  # calls into the live check
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

    def _check(self, name: str, *args, audited: bool = False):
        """`name(*args)` on the fast mirror, under the lock, timed as live-check cost;
        `audited`: its answer goes to the audit too. Raises what the audit found first: once
        it refused anything, nothing more is done."""
        with self._lock:
            start = time.perf_counter()
            try:
                self.audit.raise_error()
                answer = getattr(self.monitor, name)(*args)
                if audited:
                    self.audit.put(name, args, answer, start)
                return answer
            finally:
                self.check_s += time.perf_counter() - start
                self.checks += 1

    def emit(self, cls, *fields):
        """Stamp, check live and record one protocol event; raises Violation. Stamped under
        the lock: `t` never decreases in emission order."""
        with self._lock:
            event = cls(self.now(), *fields)
            self._check("emit", event)
        return event

    def reserve(self, req: str, prompt: int, prefix: int) -> tuple[int, ...]:
        """The mirror picks the pages; the audit's SLAB-1 checks they are the right ones."""
        with self._lock:
            return self._check("reserve", self.now(), req, prompt, prefix)

    def ask(self, query: str, *args) -> bool:
        """A query the engine decides with (can_issue, can_admit ...); audited."""
        return self._check(query, *args, audited=True)

    def stage(self, req: str, name: str, start: float, end: float, span=None, resource=None,
              tokens=None):
        self._check("stage", ev.Stage(start, req, name, end, span, resource, tokens))

    def free_page_ids(self) -> tuple[int, ...]:
        """The decoder pages the specification's pool holds free (none quarantined)."""
        return self._check("free_page_ids", audited=True)

    def unfenced(self, req: str) -> tuple:
        """Span ids of `req` whose writer has not been fenced yet."""
        return self._check("unfenced", req, audited=True)

    def close(self) -> None:
        """End of a complete run: LIFE-1 on the mirror at once, then wait (bounded) for the
        audit, which also compares the mirror's whole state with its own; raises what the
        audit found."""
        self._check("close")
        with self._lock:
            self.audit.put("close", (), None, time.perf_counter())
            self.audit.put("state", (), self.monitor.state, time.perf_counter())
        self.audit.finish()

    def stop(self) -> Exception | None:
        """A run that stopped early: the audit checks what was queued before the stop
        (bounded wait) and ends; what it found (None: nothing)."""
        return self.audit.drain()

    def trace(self) -> list:
        """Every event in time order (stable: protocol order is kept among equal times)."""
        return sorted(self.protocol + self.stages, key=lambda e: e.t)


def _sinks(protocol: list, stages: list, audit: Audit):
    """The mirror's sinks: each accepted event into the trace, and to the audit. Closures,
    not methods of the Recorder: no reference cycle through it, so a Recorder dropped
    without `close` (a test's) is freed at once and its finalizer ends the audit thread."""
    put, clock = audit.put, time.perf_counter

    def accepted(event) -> None:
        protocol.append(event)
        put("emit", (event,), None, clock())

    def staged(event: ev.Stage) -> None:
        stages.append(event)
        put("stage", (event,), None, clock())

    return accepted, staged


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
    metrics.update(rec.audit.metrics())
    return metrics
