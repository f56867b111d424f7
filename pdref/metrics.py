"""Metrics computed from a trace, one function for both shells (contract.md, 'Metrics').

Simulated and measured runs are measured the same way by construction: both shells hand
their events to `run_metrics` / `life_metrics` instead of timing things themselves.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from pdref import events as ev
from pdref.rows import ComputedRow, IssueRow, LandRow


@attrs.define
class LifeMetrics:
    """Timings of one life of a request (reserve .. release/abort), in trace seconds."""

    req: str
    start: float  # first event naming the request in this life (a stage may precede reserve)
    reserve_t: float
    prompt: int
    prefix: int
    produced_t: float | None = None
    last_land_t: float | None = None
    admit_t: float | None = None
    end_t: float | None = None
    outcome: str = "open"  # open | released | aborted
    bytes: int = 0
    spans: int = 0
    failed_spans: int = 0
    first_token: int | None = None

    @property
    def ready_t(self) -> float | None:
        """When the request could be admitted: last land, or produced if later."""
        if self.produced_t is None:
            return None
        return max(self.produced_t, self.last_land_t or self.produced_t)


class Tracker:
    """Folds events into LifeMetrics and the trace-wide staging peak. With `fences`
    (version 2) a failed or cancelled span keeps its staging until its fence: its writer
    may still hold the buffer."""

    def __init__(self, fences: bool = False, on_end=None) -> None:
        self.fences = fences
        self.live: dict[str, LifeMetrics] = {}
        self.first_seen: dict[str, float] = {}
        self.done: list[LifeMetrics] = []
        # what an ended life goes to: `done`, or a caller's fold that keeps no lives
        self.on_end = self.done.append if on_end is None else on_end
        self.in_flight: dict[object, tuple[str, int]] = {}  # span -> (req, bytes)
        self.staging = 0
        self.peak_staging = 0

    def feed(self, e) -> None:
        kind = e.kind
        if kind == "stage" and e.req in self.live:  # most events: nothing to record
            return
        if kind == "fence":
            self._retire(e.span)
            return
        if kind == "evict":  # (v4) names whom the room is for, not a life: no metric
            return
        if kind == "reserve":
            start = min(self.first_seen.pop(e.req, e.t), e.t)
            self.live[e.req] = LifeMetrics(e.req, start, e.t, e.prompt, e.prefix)
            return
        life = self.live.get(e.req)
        if life is None:
            self.first_seen.setdefault(e.req, e.t)
            return
        handler = _HANDLERS.get(kind)  # stage and computed change no metric of a live life
        if handler is not None:
            handler(self, life, e)

    def _retire(self, span) -> int:
        _, size = self.in_flight.pop(span, ("", 0))
        self.staging -= size
        return size

    def on_issue(self, life: LifeMetrics, e) -> None:
        life.spans += 1
        self.in_flight[e.span] = (e.req, e.bytes)
        staging = self.staging = self.staging + e.bytes
        if staging > self.peak_staging:  # (not max(): this runs for every span)
            self.peak_staging = staging

    def on_land(self, life: LifeMetrics, e) -> None:
        life.bytes += self._retire(e.span)
        life.last_land_t = e.t

    def on_fail(self, life: LifeMetrics, e) -> None:
        if not self.fences:
            self._retire(e.span)
        life.failed_spans += 1

    def on_produced(self, life: LifeMetrics, e) -> None:
        life.produced_t = e.t
        life.first_token = e.token

    def on_admit(self, life: LifeMetrics, e) -> None:
        life.admit_t = e.t

    def on_release(self, life: LifeMetrics, e) -> None:
        self._end(life, e, "released")

    def on_abort(self, life: LifeMetrics, e) -> None:
        if not self.fences:
            for span in [s for s, (req, _) in self.in_flight.items() if req == e.req]:
                self._retire(span)  # v1: an abort cancels the request's spans in flight
        self._end(life, e, "aborted")

    def _end(self, life: LifeMetrics, e, outcome: str) -> None:
        life.end_t, life.outcome = e.t, outcome
        self.on_end(self.live.pop(e.req))


_HANDLERS = {kind: getattr(Tracker, f"on_{kind}") for kind in
             ("issue", "land", "fail", "produced", "admit", "release", "abort")}


def life_metrics(events: Iterable, fences: bool = True) -> tuple[list[LifeMetrics], int]:
    """Every request life in the trace (ended ones first, then open ones) and peak staging.
    `fences`: the trace is version 2 (staging is held until a fence)."""
    tracker = Tracker(fences)
    track(tracker, events)
    return tracker.done + list(tracker.live.values()), tracker.peak_staging


def track(tracker: Tracker, events: Iterable) -> None:
    """Fold `events` into `tracker` (in parts too: a run's events as they come)."""
    feed, live = tracker.feed, tracker.live
    # no metric of a live life: most events, skipped here (rows: pdref.rows, as the events)
    silent = (ev.Stage, ev.Computed, ComputedRow)
    writers = {ev.Issue: tracker.on_issue, IssueRow: tracker.on_issue,  # most of the rest:
               ev.Land: tracker.on_land, LandRow: tracker.on_land}  # `feed`'s dispatch inlined
    for event in events:
        cls = type(event)
        if cls in silent and event.req in live:
            continue
        on_writer = writers.get(cls)
        if on_writer is not None:
            life = live.get(event.req)
            if life is not None:
                on_writer(life, event)
                continue
        feed(event)


def run_metrics(header: ev.Header, events: Iterable, report_token: bool = True) -> dict:
    """contract.md's metrics of a run, for its last request that produced.

    Times run from that request's first event (so a failed life and its retry both count,
    and earlier requests of a back-to-back run do not); in a one-request run that is the
    run start. `peak_staging_bytes` is trace-wide. `report_token=False` for the simulator.
    """
    lives, peak = life_metrics(events, header.version >= 2)
    produced = [life for life in lives if life.produced_t is not None]
    final = produced[-1] if produced else (lives[-1] if lives else None)
    mine = [life for life in lives if final and life.req == final.req]
    start = min((life.start for life in mine), default=0.0)
    ready = final.ready_t if final else None
    prefill = final.produced_t if final else None
    return {
        "mode": str(header.mode),
        "prompt": final.prompt if final else None,
        "prefix": final.prefix if final else None,
        "chunk": header.get("chunk"),
        "max_pending": header.max_pending,
        "bytes": final.bytes if final else 0,
        "spans": sum(life.spans for life in mine),
        "prefill_s": None if prefill is None else prefill - start,
        "handoff_s": None if ready is None else ready - start,
        "tail_s": None if ready is None else ready - prefill,
        "peak_staging_bytes": peak,
        "first_token": final.first_token if (final and report_token) else None,
        "failed_spans": sum(life.failed_spans for life in mine),
        "lives": len(mine),
    }
