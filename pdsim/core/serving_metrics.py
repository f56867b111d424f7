"""The serving summary of a simulated run, named and defined as `pdgpu serve` reports it
(pdgpu/serve/report.py; specs/contract.md, 'Serving runs').

Over the requests that ended ok: TTFT runs from arrival (closed loop: the moment it entered)
to its first output token, which the producer makes (`produced` of its last life); ITL is the
time between consecutive output tokens: first token to the end of its first decode step,
then each further step's time. Percentiles are nearest-rank. `tokens_per_s` counts every
generated token (the first one too) over `wall_s`, the run's end.
"""

from __future__ import annotations

import numpy as np

from pdsim.core.decoder import DecodeRecord
from pdsim.core.quantiles import Quantiles
from pdsim.core.running import RunningMetrics
from pdsim.core.sim import SimResult


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


def drain_steps(record: DecodeRecord, itl: Quantiles) -> tuple[list, list]:
    """Move the record's ended decode steps into `itl` (a run that keeps no record); their
    (starts, ends), for the caller's checks. Every request that decodes ends ok in such a
    run (no faults), so a step counts once for each request in its batch but at its first
    step (`inter_token_gaps`' counts), and a request's first gap is known at its first
    step's end. `record.tokens` must still hold every request whose first step is drained."""
    count = len(record.step_end)
    base = record.drained
    starts, ends = record.step_start[:count], record.step_end[:count]
    end = np.asarray(ends, dtype=float)
    batch = np.asarray(record.take_batches(count), dtype=np.int64)
    firsts = [(t, first - base) for t, first, steps in record.tokens.values()
              if steps and base <= first < base + count]
    # [M, 2]: (first token time, first step - base) of the requests that began decoding here
    table = np.array(firsts, dtype=float).reshape(-1, 2)
    first = table[:, 1].astype(np.int64)
    itl.extend(end[first] - table[:, 0], np.ones(len(first), dtype=np.int64))
    itl.extend(end - np.asarray(starts, dtype=float),
               batch - np.bincount(first, minlength=count))
    del record.step_start[:count], record.step_end[:count]
    return starts, ends


def serving_metrics(running: RunningMetrics, record: DecodeRecord, leaked_pages: int) -> dict:
    """pdgpu serve's summary keys (wall_s: simulated seconds), plus the decode batch's
    step count, generated tokens and mean batch."""
    makespan = running.makespan
    return {
        "ok": running.ok,
        "tokens_per_s": running.generated / makespan if makespan > 0 else None,
        "ttft_p50_s": running.ttft.percentile(50), "ttft_p99_s": running.ttft.percentile(99),
        "itl_p50_s": running.itl.percentile(50), "itl_p99_s": running.itl.percentile(99),
        "handoff_p50_s": running.handoff.percentile(50),
        "peak_pool_pages": running.pool.peak, "leaked_pages": leaked_pages,
        "wall_s": makespan, "generated_tokens": running.generated,
        "decode_steps": record.steps, "decode_batch_mean": record.batch_mean(),
    }
