"""Metrics of a simulated run: contract.md's (computed by pdref from the events, exactly as for an
engine run) plus the simulator's own: pipeline lower bound and gap, and for workloads TTFT
percentiles, pool occupancy and throughput."""

from __future__ import annotations

import numpy as np

from pdref.metrics import life_metrics, run_metrics
from pdsim.bounds import copy_total_s, lower_bound_s
from pdsim.sim import SimResult


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
        events=len(result.events),
    )
    return out


def workload_metrics(result: SimResult) -> dict:
    """Aggregate metrics of a many-request run: TTFT p50/p99, occupancy, throughput."""
    lives, peak = life_metrics(result.events)
    cfg = result.cfg
    makespan = max((life.end_t for life in lives), default=0.0)
    occupancy, peak_pages = _occupancy(result)
    out = {"mode": str(cfg.mode), "chunk": cfg.chunk, "max_pending": cfg.max_pending,
           **dict(cfg.labels), "requests": len(lives), "producers": cfg.producers,
           "pool_pages": cfg.pool_pages, "bytes": sum(life.bytes for life in lives),
           "spans": sum(life.spans for life in lives)}
    out.update(_latencies(result, lives))
    out.update(_rates(lives, makespan))
    out.update(pool_occupancy_mean=occupancy, pool_peak_pages=peak_pages,
               peak_staging_bytes=peak, events=len(result.events))
    return out


def _latencies(result: SimResult, lives) -> dict:
    """TTFT (arrival to admissible at the decoder), queueing, and the unhidden tail."""
    arrival = {r.req: r.arrival for r in result.requests}
    ttft = np.array([life.ready_t - arrival[life.req] for life in lives])
    wait = np.array([life.reserve_t - arrival[life.req] for life in lives])
    return {"ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "queue_wait_p99_s": float(np.percentile(wait, 99)),
            "tail_mean_s": float(np.mean([life.ready_t - life.produced_t for life in lives]))}


def _rates(lives, makespan: float) -> dict:
    tokens = sum(life.prompt - life.prefix for life in lives)
    return {"makespan_s": makespan,
            "throughput_rps": len(lives) / makespan if makespan > 0 else 0.0,
            "prefill_tokens_per_sec": tokens / makespan if makespan > 0 else 0.0}


def _occupancy(result: SimResult) -> tuple[float, int]:
    """Time-averaged fraction of pool pages held, and the most pages held at once."""
    held: dict[str, int] = {}
    used = peak = 0
    area = last_t = 0.0
    for e in result.events:
        if e.kind not in ("reserve", "release", "abort"):
            continue
        area += used * (e.t - last_t)
        last_t = e.t
        if e.kind == "reserve":
            held[e.req] = len(e.pages)
            used += len(e.pages)
        else:
            used -= held.pop(e.req, 0)
        peak = max(peak, used)
    mean = area / (last_t * result.cfg.pool_pages) if last_t > 0 else 0.0
    return mean, peak
