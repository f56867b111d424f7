"""Metrics of a simulated run: contract.md's (computed by pdref from the events, exactly as for an
engine run) plus the simulator's own: pipeline lower bound and gap, and for workloads pool
occupancy, throughput and pdgpu serve's summary (serving_metrics.py: tokens/s, TTFT, ITL)."""

from __future__ import annotations

from pdref.metrics import run_metrics
from pdsim.core.running import RunningMetrics
from pdsim.core.serving_metrics import inter_token_gaps, serving_metrics
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
    that ended ok (released), with TTFT from the request's arrival (so retries cost). A
    streamed run (`result.running`) was folded while it ran; any other is folded now."""
    running = result.running if result.running is not None else fold_result(result)
    cfg = result.cfg
    out = {"mode": str(cfg.mode), "chunk": cfg.chunk, "max_pending": cfg.max_pending,
           **dict(cfg.labels), "requests": running.requests, "producers": cfg.producers,
           "pool_pages": cfg.pool_pages, "bytes": running.bytes, "spans": running.spans}
    if result.outcomes:
        out.update(outcome_counts(result, running))
    makespan = running.makespan
    out.update(queue_wait_p99_s=running.wait.interpolated(99), tail_mean_s=running.tail.mean())
    out.update(_rates(running.ok, running.prompt_tokens, makespan))
    out.update(pool_occupancy_mean=running.occupancy, pool_peak_pages=running.pool.peak,
               peak_staging_bytes=running.peak_staging, events=running.events)
    out.update(serving_metrics(running, result.decode, result.leaked_pages))
    if result.prefix_cache:  # prompt tokens found in the decoder's cache, of those looked up
        counts = dict(result.prefix_cache)
        queries = counts["prefix_cache_queries"]
        out.update(counts, prefix_cache_hit_rate=counts["prefix_cache_hits"] / queries
                   if queries else 0.0)
    return out


def serving_summary(result: SimResult) -> dict:
    """pdgpu serve's summary keys alone (serving_metrics.py), e.g. for a one-request run."""
    running = fold_result(result)
    return {"requests": running.requests,
            **serving_metrics(running, result.decode, result.leaked_pages)}


def fold_result(result: SimResult) -> RunningMetrics:
    """The running metrics of a run that kept its events, folded from them now."""
    arrival = {r.req: r.arrival for r in result.requests}
    outputs = {r.req: result.cfg.output_of(r) for r in result.requests}
    tokens = result.decode.tokens
    running = RunningMetrics(result.cfg.pool_pages,
                             lambda req: (arrival[req], tokens[req][0], outputs[req]),
                             faults=bool(result.outcomes), keep_ok=True)
    running.track(result.protocol_rows)  # stages change no metric of a workload
    running.open_lives()
    running.itl.extend(*inter_token_gaps(result, running.ok_reqs))
    running.requests = len(result.requests)
    running.events = result.event_count + (result.decode.steps if result.cfg.stages else 0)
    return running


def outcome_counts(result: SimResult, running: RunningMetrics) -> dict:
    """ok / cancelled / failed requests, lives spent, failed spans, fences, leaked pages."""
    statuses = [o.status for o in result.outcomes]
    return {"ok": statuses.count("ok"), "cancelled": statuses.count("cancelled"),
            "failed": statuses.count("failed"), "lives": running.lives,
            "failed_spans": running.failed_spans, "fences": running.fences,
            "leaked_pages": result.leaked_pages}


def _rates(ok: int, tokens: int, makespan: float) -> dict:
    return {"makespan_s": makespan,
            "throughput_rps": ok / makespan if makespan > 0 else 0.0,
            "prefill_tokens_per_sec": tokens / makespan if makespan > 0 else 0.0}
