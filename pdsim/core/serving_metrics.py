"""The serving summary of a simulated run, named and defined as `pdgpu serve` reports it
(pdgpu/serve/report.py; specs/contract.md, 'Serving runs').

Over the requests that ended ok: TTFT runs from arrival (closed loop: the moment it entered)
to its first output token, which the producer makes (`produced` of its last life); ITL is the
time between consecutive output tokens: first token to the end of its first decode step,
then each further step's time. Percentiles are nearest-rank. `tokens_per_s` counts every
generated token (the first one too) over `wall_s`, the run's end.
"""

from __future__ import annotations

import math

import numpy as np

from pdsim.core.sim import SimResult


def percentile(values, q: float) -> float | None:
    """Nearest-rank percentile (q in (0, 100]), as pdgpu serve's; None for no values."""
    if not len(values):
        return None
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)])


def weighted_percentiles(values, weights, qs) -> list[float | None]:
    """Nearest-rank percentiles of `values`, each counted `weights` times, for each q of
    `qs` (one sort for all); None for none."""
    values = np.asarray(values, dtype=float)
    weights = np.asarray(weights, dtype=np.int64)
    total = int(weights.sum())
    if total <= 0:
        return [None for _ in qs]
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    ranks = [max(1, math.ceil(q / 100 * total)) for q in qs]
    return [float(values[order[np.searchsorted(cumulative, rank)]]) for rank in ranks]


def inter_token_gaps(result: SimResult, ok_reqs) -> tuple[np.ndarray, np.ndarray]:
    """Every ok request's inter-token gaps as (values, counts): its first gap, then each
    decode step it took part in after its first, counted once per such request."""
    record = result.decode
    start = np.asarray(record.step_start, dtype=float)  # (a dtype: no type discovery)
    end = np.asarray(record.step_end, dtype=float)
    # [N, 3]: (first token time, first decode step, decode steps) of each ok request
    table = np.array([record.tokens[req] for req in ok_reqs], dtype=float).reshape(-1, 3)
    decoding = table[table[:, 2] > 0]
    first_t, first = decoding[:, 0], decoding[:, 1].astype(np.int64)
    last = first + decoding[:, 2].astype(np.int64)
    firsts = end[first] - first_t
    # each request counts once in every step it took after its first: [first + 1, last)
    counts = (np.bincount(first + 1, minlength=len(end) + 1)
              - np.bincount(last, minlength=len(end) + 1))
    per_step = np.cumsum(counts)[:len(end)]
    values = np.concatenate([firsts, end - start])
    weights = np.concatenate([np.ones(len(firsts), dtype=np.int64), per_step])
    return values, weights


def serving_metrics(result: SimResult, ok_lives, makespan: float, peak_pages: int) -> dict:
    """pdgpu serve's summary keys (wall_s: simulated seconds), plus the decode batch's
    step count, generated tokens and mean batch."""
    arrival = {r.req: r.arrival for r in result.requests}
    outputs = {r.req: result.cfg.output_of(r) for r in result.requests}
    record = result.decode
    ok_reqs = [life.req for life in ok_lives]
    ttft = [record.tokens[req][0] - arrival[req] for req in ok_reqs]
    gaps, counts = inter_token_gaps(result, ok_reqs)
    itl_p50, itl_p99 = weighted_percentiles(gaps, counts, (50, 99))
    handoff = [life.ready_t - life.reserve_t for life in ok_lives if life.ready_t is not None]
    generated = sum(outputs[req] for req in ok_reqs)
    return {
        "ok": len(ok_reqs),
        "tokens_per_s": generated / makespan if makespan > 0 else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": itl_p50, "itl_p99_s": itl_p99,
        "handoff_p50_s": percentile(handoff, 50),
        "peak_pool_pages": peak_pages, "leaked_pages": result.leaked_pages,
        "wall_s": makespan, "generated_tokens": generated, "decode_steps": record.steps,
        "decode_batch_mean": record.batch_mean(),
    }
