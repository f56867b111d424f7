"""Metrics of a simulated run: contract.md's (computed by pdref from the events, exactly as for an
engine run) plus the simulator's own: pipeline lower bound and gap, and for workloads pool
occupancy, throughput and pdgpu serve's summary (serving_metrics.py: tokens/s, TTFT, ITL)."""

from __future__ import annotations

from functools import partial
from itertools import compress
from operator import is_

import numpy as np

from pdref.events import Abort, Fence, Release, Reserve
from pdref.metrics import life_metrics, run_metrics
from pdsim.core.serving_metrics import serving_metrics
from pdsim.core.sim import SimResult
from pdsim.core.steps import copy_total_s, lower_bound_s


def single_metrics(result: SimResult) -> dict:
    """contract.md metrics of a one-request run, with the lower bound and the gap to it."""
    cfg, request = result.cfg, result.requests[0]
    out = run_metrics(result.header, result.events, report_token=False)
    bound = lower_bound_s(cfg, request)
    handoff = out["handoff_s"]
    out.update(dict(cfg.labels))
    out.update(
        lower_bound_s=bound,
        gap_s=handoff - bound,
        gap_pct=100.0 * (handoff - bound) / bound if bound > 0 else 0.0,
        copy_busy_s=copy_total_s(cfg, request),
        state_bytes=cfg.costs.state_bytes if out["spans"] else 0,
        no_compute=cfg.no_compute,
        events=result.event_count,
    )
    return out


def workload_metrics(result: SimResult) -> dict:
    """Aggregate metrics of a many-request run: TTFT p50/p99, occupancy, throughput; with
    faults also the outcome counts and leaked pages. Latencies and rates count the lives
    that ended ok (released), with TTFT from the request's arrival (so retries cost)."""
    lives, peak = life_metrics(result.protocol_rows)  # stages change no metric of a workload
    ok = [life for life in lives if life.outcome == "released"]
    cfg = result.cfg
    makespan = max((life.end_t for life in lives), default=0.0)
    occupancy, peak_pages = _occupancy(result)
    out = {"mode": str(cfg.mode), "chunk": cfg.chunk, "max_pending": cfg.max_pending,
           **dict(cfg.labels), "requests": len(result.requests), "producers": cfg.producers,
           "pool_pages": cfg.pool_pages, "bytes": sum(life.bytes for life in lives),
           "spans": sum(life.spans for life in lives)}
    if result.outcomes:
        out.update(outcome_counts(result, lives))
    out.update(_latencies(result, ok))
    out.update(_rates(ok, makespan))
    out.update(pool_occupancy_mean=occupancy, pool_peak_pages=peak_pages,
               peak_staging_bytes=peak,
               events=result.event_count + (result.decode.steps if cfg.stages else 0))
    out.update(serving_metrics(result, ok, makespan, peak_pages))
    return out


def serving_summary(result: SimResult) -> dict:
    """pdgpu serve's summary keys alone (serving_metrics.py), e.g. for a one-request run."""
    lives, _ = life_metrics(result.protocol_rows)
    ok = [life for life in lives if life.outcome == "released"]
    makespan = max((life.end_t for life in lives), default=0.0)
    return {"requests": len(result.requests),
            **serving_metrics(result, ok, makespan, _occupancy(result)[1])}


def outcome_counts(result: SimResult, lives) -> dict:
    """ok / cancelled / failed requests, lives spent, failed spans, fences, leaked pages."""
    statuses = [o.status for o in result.outcomes]
    return {"ok": statuses.count("ok"), "cancelled": statuses.count("cancelled"),
            "failed": statuses.count("failed"), "lives": len(lives),
            "failed_spans": sum(life.failed_spans for life in lives),
            "fences": sum(e.kind == "fence" for e in result.protocol_rows),
            "leaked_pages": result.leaked_pages}


def _percentile(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _latencies(result: SimResult, lives) -> dict:
    """Queueing (arrival to reserve) and the unhidden tail; TTFT: serving_metrics."""
    arrival = {r.req: r.arrival for r in result.requests}
    wait = np.array([life.reserve_t - arrival[life.req] for life in lives])
    tails = [life.ready_t - life.produced_t for life in lives]
    return {"queue_wait_p99_s": _percentile(wait, 99),
            "tail_mean_s": float(np.mean(tails)) if tails else None}


def _rates(lives, makespan: float) -> dict:
    tokens = sum(life.prompt - life.prefix for life in lives)
    return {"makespan_s": makespan,
            "throughput_rps": len(lives) / makespan if makespan > 0 else 0.0,
            "prefill_tokens_per_sec": tokens / makespan if makespan > 0 else 0.0}


def _occupancy(result: SimResult) -> tuple[float, int]:
    """Time-averaged fraction of pool pages held (quarantined ones too), and the most pages
    held at once."""
    pool = _PoolUse()
    area = last_t = 0.0
    events = result.protocol_rows
    if not result.outcomes or next(_by_kind(events, Abort), None) is None:
        # no life was aborted (only runs with faults abort): no page is ever quarantined,
        # spans in flight never matter
        events = compress(events, map(_POOL_TYPES.__contains__, map(type, events)))
    for e in events:
        kind = e.kind
        if kind in _WRITER_KINDS:
            getattr(pool, kind)(e)
        elif kind in _POOL_KINDS:  # the pages held may change here
            area += pool.used * (e.t - last_t)
            last_t = e.t
            getattr(pool, kind)(e)
    mean = area / (last_t * result.cfg.pool_pages) if last_t > 0 else 0.0
    return mean, pool.peak


_POOL_KINDS = frozenset(("reserve", "release", "abort", "fence"))
_POOL_TYPES = frozenset((Reserve, Release, Fence))
_WRITER_KINDS = frozenset(("issue", "land"))


def _by_kind(events, cls):
    """The events of class `cls` (a pass in C: `map(type, ...)`)."""
    return compress(events, map(partial(is_, cls), map(type, events)))


class _PoolUse:
    """Pages held by live slabs and by aborted slabs until their last writer's fence."""

    def __init__(self) -> None:
        self.used = self.peak = 0
        self.held: dict[str, int] = {}  # live request -> pages
        self.writers: dict[object, str] = {}  # span not yet landed or fenced -> request
        self.quarantine: dict[str, list[int]] = {}  # req -> [pages, writers left] (per life)
        self.owner: dict[object, str] = {}  # unfenced span of an ended life -> its quarantine

    def reserve(self, e) -> None:
        self.held[e.req] = len(e.pages)
        self.used += len(e.pages)
        self.peak = max(self.peak, self.used)

    def issue(self, e) -> None:
        self.writers[e.span] = e.req

    def land(self, e) -> None:
        self.writers.pop(e.span, None)

    def release(self, e) -> None:
        self.used -= self.held.pop(e.req, 0)

    def abort(self, e) -> None:
        pages = self.held.pop(e.req, 0)
        mine = [s for s, req in self.writers.items() if req == e.req]
        if not mine:
            self.used -= pages
            return
        key = f"{e.req}@{e.t}#{len(self.quarantine)}"
        self.quarantine[key] = [pages, len(mine)]
        for span in mine:
            del self.writers[span]
            self.owner[span] = key

    def fence(self, e) -> None:
        self.writers.pop(e.span, None)  # a failed span of a live life
        key = self.owner.pop(e.span, None)
        if key is None:
            return
        held = self.quarantine[key]
        held[1] -= 1
        if not held[1]:
            self.used -= self.quarantine.pop(key)[0]
