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

from pdgpu.audit import BOUND
from pdgpu.live_check import LiveCheck
from pdref import events as ev
from pdref.metrics import run_metrics
from pdref.monitor import Monitor

STAGE_NAMES = ("compute", "head", "blocked", "fill", "gather", "d2h", "h2d")


class Recorder:
    """The run clock, span ids, the events, and the live check (`live`, live_check.py) with
    the Recorder's lock (engine thread and copier watcher both emit) and its sinks (the
    protocol events and the stages, kept apart)."""

    def __init__(self, header: ev.Header, audit_monitor=Monitor, audit_bound: int = BOUND) -> None:
        self.header = header
        self.protocol: list = []
        self.stages: list[ev.Stage] = []
        self.live = LiveCheck(header, self.protocol.append, self.stages.append,
                              threading.RLock(), audit_monitor, audit_bound)
        self._spans = itertools.count()
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

    def emit(self, cls, *fields):
        """Stamp, check live and record one protocol event; raises Violation. Stamped under
        the lock: `t` never decreases in emission order."""
        with self.live.lock:
            event = cls(self.now(), *fields)
            self.live.ask("emit", event)
        return event

    def reserve(self, req: str, prompt: int, prefix: int,
                state_slot: int | None = None) -> tuple[int, ...]:
        """The mirror picks the pages; the audit's SLAB-1 checks they are the right ones.
        (v3) `state_slot`: the producer's, as `free_state_slot` named it."""
        with self.live.lock:
            return self.live.ask("reserve", self.now(), req, prompt, prefix, "p0", state_slot)

    def ask(self, query: str, *args) -> bool:
        """A query the engine decides with (can_issue, can_admit ...); audited."""
        return self.live.ask(query, *args, audited=True)

    def stage(self, req: str, name: str, start: float, end: float, span=None, resource=None,
              tokens=None):
        self.live.ask("stage", ev.Stage(start, req, name, end, span, resource, tokens))

    def free_page_ids(self) -> tuple[int, ...]:
        """The decoder pages the specification's pool holds free (none quarantined)."""
        return self.live.ask("free_page_ids", audited=True)

    def unfenced(self, req: str) -> tuple:
        """Span ids of `req` whose writer has not been fenced yet."""
        return self.live.ask("unfenced", req, audited=True)

    def close(self) -> None:
        """End of a complete run: the live check's end (raises what the audit found)."""
        self.live.close()

    def stop(self) -> Exception | None:
        """A run that stopped early: the audit checks what was queued before the stop
        (bounded wait) and ends; what it found (None: nothing)."""
        return self.live.stop()

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
    metrics.update(rec.live.metrics(wall_s))
    return metrics
