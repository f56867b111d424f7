"""Least-squares fits of the cost model's linear terms (numpy), non-negative by active set."""

from __future__ import annotations

from collections import defaultdict

import attrs
import numpy as np

from pdsim.fit.samples import ComputeSample, CopySample, DecodeSample
from pdsim.fit.serve_samples import GapSample
from pdsim.fit.sharing import CANDIDATES, SLOWDOWNS, Sharing, load_factor, run_cores, work_alone


@attrs.frozen
class Fit:
    """Fitted coefficients of one linear model and how well it fits."""

    names: tuple[str, ...]
    values: tuple[float, ...]
    samples: int
    rank: int
    rms: float  # root-mean-square residual, seconds
    mean: float  # mean of the fitted quantity, seconds

    def get(self, name: str) -> float:
        return self.values[self.names.index(name)]

    @property
    def rel_rms(self) -> float:
        return self.rms / self.mean if self.mean > 0 else 0.0


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, int]:
    """Least squares with every coefficient >= 0 (drop the most negative, refit); rank."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = [i for i in range(x.shape[1]) if np.any(x[:, i])]
    rank = int(np.linalg.matrix_rank(xs[:, active])) if active else 0
    while True:
        coef = np.zeros(x.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(xs[:, active], y, rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef / scale, rank
        active.remove(min(negative, key=lambda i: coef[i]))


def fit(names: tuple[str, ...], x: np.ndarray, y: np.ndarray, rounds: int = 3) -> Fit:
    """Non-negative least squares, refitted without outliers (residual > 5 robust sigmas)
    up to `rounds` times (0: every sample kept). No samples: every coefficient 0 and
    `samples` 0 (e.g. compute terms of export traces)."""
    if not len(y):
        return Fit(names, (0.0,) * len(names), 0, 0, 0.0, 0.0)
    keep = np.ones(len(y), dtype=bool)
    coef, rank = nonneg_lstsq(x, y)
    for _ in range(rounds):
        residual = y - x @ coef
        sigma = 1.4826 * float(np.median(np.abs(residual[keep]))) if keep.any() else 0.0
        outliers = np.abs(residual) > 5 * sigma + 1e-12 * np.abs(y).max(initial=0.0)
        if sigma == 0 or not (outliers & keep).any():
            break
        keep &= ~outliers
        coef, rank = nonneg_lstsq(x[keep], y[keep])
    residual = (y - x @ coef)[keep]
    rms = float(np.sqrt(np.mean(residual**2))) if keep.any() else 0.0
    return Fit(names, tuple(float(c) for c in coef), int(keep.sum()), rank, rms,
               float(np.mean(y[keep])) if keep.any() else 0.0)


def fit_compute(samples: list[ComputeSample], dense: bool = False,
                cores: float | None = None, slowdown: float = 0.0) -> Fit:
    """duration = f * (chunk_s * chunks + token_s * n + pair_s * pairs) + contention * overlap
    (+ land_contention * bytes landed beside it, on shared host cores where spans landed);
    pairs: the causal triangle, or with `dense` the masked rectangle (triangle + masked).
    With `cores` (shared host cores), each duration is first divided by its slowdown (and
    by other work's, `slowdown`: sharing.load_factor)."""
    landed = cores is not None and any(s.landed for s in samples)
    names = ("chunk_s", "token_s", "pair_s", "contention", *(("land_contention",) * landed))
    # On shared host cores the slow tail (work beside a chunk that no stage shows) is part
    # of serving: every sample is kept, so the terms give the mean chunk, which throughput
    # and TTFT add up (trimmed, one training run's chunks came out 44.7 ms on average in
    # the simulator against its own 53.1 ms; 2026-12-03).
    rounds = 3 if cores is None else 0
    return fit(names, compute_rows(samples, dense, landed), alone(samples, cores, slowdown),
               rounds)


def compute_rows(samples: list[ComputeSample], dense: bool, landed: bool = False) -> np.ndarray:
    """`landed`: a last column of the bytes landed beside each (shared host cores only:
    cores.py)."""
    rows = []
    for s in samples:
        a, b = s.tokens
        pairs = (b * (b + 1) - a * (a + 1)) / 2 + (s.masked if dense else 0.0)
        rows.append([s.fraction * s.chunks, s.fraction * (b - a), s.fraction * pairs, s.overlap,
                     *((s.landed,) * landed)])
    return np.array(rows, dtype=float).reshape(-1, 4 + landed)


def alone(samples, cores: float | None, slowdown: float = 0.0) -> np.ndarray:
    """The samples' durations as if each had run alone on its core (processor sharing) on a
    host with no other work (`slowdown` per share of the host other work held: sharing.py)."""
    return np.array([work_alone(s.duration, s.running, run_cores(cores, s.free))
                     / load_factor(slowdown, s.free) for s in samples], dtype=float)


def fit_attention(samples: list[ComputeSample], cores: float | None = None,
                  slowdown: float = 0.0) -> tuple[Fit, bool]:
    """The better of the causal and the dense attention model (smaller rms residual)."""
    causal = fit_compute(samples, cores=cores, slowdown=slowdown)
    dense = fit_compute(samples, True, cores, slowdown)
    if dense.rms < causal.rms * (1 - 1e-6) and dense.samples >= causal.samples:
        return dense, True
    return causal, False


def decode_rows(samples: list[DecodeSample]) -> np.ndarray:
    return np.array([[1.0, s.batch, s.kv_tokens] for s in samples], dtype=float).reshape(-1, 3)


def fit_decode(samples: list[DecodeSample], cores: float | None = None,
               slowdown: float = 0.0) -> Fit:
    """One batched decode step: duration = decode_s + decode_row_s * batch
    + decode_kv_token_s * kv_tokens (the KV tokens its attention read); with `cores`, the
    durations as if alone (processor sharing; other work's `slowdown` taken out)."""
    return fit(("decode_s", "decode_row_s", "decode_kv_token_s"), decode_rows(samples),
               alone(samples, cores, slowdown))


def fit_host_cores(computes: list[ComputeSample], decodes: list[DecodeSample],
                   host: int | None = None) -> Sharing:
    """The effective host core count under which compute and decode times alone (processor
    sharing taken out, sharing.py) are best explained by their linear terms (mean squared
    log error, every sample); None (dedicated devices) unless some ran together and a count
    does better than none by over 1%. `host`: the engine ran on one host of that many cores
    (CPU devices), so the count is one of at most `host`, never dedicated devices. When
    some samples' runs had other work beside them (`free` < 1, measured), the slowdown it
    caused (sharing.load_factor) is fitted with the count."""
    peak = max((n for s in (*computes, *decodes) for _, n in s.running), default=1)
    loaded = any(s.free < 1.0 for s in (*computes, *decodes))
    slowdowns = SLOWDOWNS if loaded else (0.0,)
    if host is not None:
        counts = sorted({*(c for c in CANDIDATES if c < min(peak, host)), float(host)})
        shares = [Sharing(c, k) for c in counts for k in slowdowns]
        return min(shares, key=lambda h: (sharing_error(computes, decodes, h), -h.cores,
                                          h.slowdown))
    if peak <= 1 and not loaded:
        return Sharing(None)
    scores = {h: sharing_error(computes, decodes, h)
              for h in (*(Sharing(None, k) for k in slowdowns),
                        *(Sharing(c, k) for c in CANDIDATES if c < peak for k in slowdowns))}
    best = min(scores, key=lambda h: (scores[h], h.cores is not None, h.slowdown))
    alone_best = min(scores[h] for h in scores if h.cores is None)
    if scores[best] < 0.99 * alone_best:
        return best
    return min((h for h in scores if h.cores is None), key=lambda h: (scores[h], h.slowdown))


def sharing_error(computes, decodes, sharing: Sharing) -> float:
    """Mean squared log error of the linear terms fitted on the times alone under `sharing`
    against those times."""
    errors, cores, slowdown = [], sharing.cores, sharing.slowdown
    if computes:
        compute, dense = fit_attention(computes, cores, slowdown)
        landed = "land_contention" in compute.names
        predicted = compute_rows(computes, dense, landed) @ np.array(compute.values)
        errors.append(log_errors(predicted, alone(computes, cores, slowdown)))
    if decodes:
        decode = fit_decode(decodes, cores, slowdown)
        predicted = decode_rows(decodes) @ np.array(decode.values)
        errors.append(log_errors(predicted, alone(decodes, cores, slowdown)))
    both = np.concatenate(errors)
    return float(np.mean(both**2)) if len(both) else 0.0


def log_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    ok = (predicted > 0) & (measured > 0)
    return np.log(predicted[ok] / measured[ok])


def fit_decode_gap(samples: list[GapSample]) -> Fit:
    """The decoder loop between two steps: gap = decode_gap_s + land_byte_s * bytes landed
    + admit_byte_s * context bytes admitted there."""
    x = np.array([[1.0, s.land_bytes, s.admit_bytes] for s in samples],
                 dtype=float).reshape(-1, 3)
    y = np.array([s.duration for s in samples], dtype=float)
    return fit(("decode_gap_s", "land_byte_s", "admit_byte_s"), x, y)


def fit_stage(copies: list[CopySample], name: str) -> Fit:
    """duration of stage `name` = intercept + per_byte * bytes."""
    pairs = [(c.nbytes, c.stage(name)) for c in copies if c.stage(name) is not None]
    x = np.array([[1.0, n] for n, _ in pairs], dtype=float).reshape(-1, 2)
    y = np.array([b - a for _, (a, b) in pairs], dtype=float)
    return fit(("intercept_s", "per_byte_s"), x, y)


def link_stage_names(copies: list[CopySample]) -> list[str]:
    seen: dict[str, None] = {}
    for c in copies:
        for name, _, _ in c.stages:
            if name != "gather":
                seen.setdefault(name, None)
    return list(seen)


def is_streamed(copies: list[CopySample], names: list[str]) -> bool:
    """True when, in most spans, the second link stage starts before the first ends (the
    bytes stream through the link's stages: link profile `pipelined`)."""
    if len(names) < 2:
        return True
    votes = [c.stage(names[1])[0] < c.stage(names[0])[1] - 1e-12 for c in copies
             if c.stage(names[0]) and c.stage(names[1])]
    return sum(votes) * 2 > len(votes)


def copier_of(copies: list[CopySample]) -> str | None:
    """"pipelined" or "serial" by most votes of the spans that were issued while the span
    before them (same trace) had not landed: on a serial copier such a span's first stage
    waits for that land, on a pipelined one it starts before. None without such a span."""
    votes, prev = [], {}
    for c in copies:
        before = prev.get((c.trace, c.producer))
        if before is not None and c.issue < before.land:
            first = min(a for _, a, _ in c.stages)
            votes.append(first < max(b for _, _, b in before.stages) - 1e-12)
        prev[(c.trace, c.producer)] = c
    if not votes:
        return None
    return "pipelined" if sum(votes) * 2 > len(votes) else "serial"


def median(values) -> float:
    return float(np.median(values)) if len(values) else 0.0


@attrs.frozen
class FixedCost:
    span_s: float  # before the gather (wake-up, readiness wait) and after the last stage
    latency_s: float  # between gather and link, plus the link stages' intercepts
    rms: float  # residual of the last spans' issue-to-land time, seconds


def fit_fixed(copies: list[CopySample], gather: Fit, links, pipelined: bool) -> FixedCost:
    """The per-span fixed costs around the bandwidth terms of a serial copier (one copy
    worker per producer of a trace); `pipelined`: the link's stages stream (overlap within a
    span)."""
    pre, gaps, post, lasts, ends = [], [], [], [], {}
    for c in copies:
        worker = (c.trace, c.producer)  # each trace has its own clock: a worker starts free
        g = c.stage("gather")
        start, end = max(c.issue, ends.get(worker, 0.0)), max(b for _, _, b in c.stages)
        pre.append((g or c.stages[0][1:])[0] - start)
        link = [c.stage(n) for n, _ in links if c.stage(n)]
        if g and link:
            gaps.append(link[0][0] - g[1])
        if c.last:  # an engine harvests the last span after `produced`, not before
            post.append(c.land - (max(end, c.produced) if c.land >= c.produced else end))
            lasts.append((c, start))
        ends[worker] = end
    intercepts = [f.get("intercept_s") for _, f in links] or [0.0]
    latency = max(0.0, median(gaps)) + (max(intercepts) if pipelined else sum(intercepts))
    span_s = max(0.0, median(pre)) + max(0.0, median(post)) + gather.get("intercept_s")
    per_link = [f.get("per_byte_s") for _, f in links] or [0.0]
    per_byte = gather.get("per_byte_s") + (max(per_link) if pipelined else sum(per_link))
    errors = [c.land - start - (span_s + latency + per_byte * c.nbytes) for c, start in lasts]
    rms = float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0
    return FixedCost(span_s, latency, rms)


def fit_fixed_pipelined(copies: list[CopySample], gather: Fit, links,
                        streamed: bool) -> FixedCost:
    """The per-span fixed costs of a pipelined copier (a lane per stage, pdsim/core/copier.py):
    issue to gather start and gather end to the first link stage, each where that lane was
    free (no queueing inside), between link stages alike, and last stage to `land` (the
    watcher). span_s = before the gather + after the last stage + the gather's intercept;
    latency = the gaps + the link stages' intercepts."""
    pre, gaps, post, alone = [], defaultdict(list), [], []
    lanes, lands = defaultdict(dict), {}
    for c in copies:
        worker = (c.trace, c.producer)  # each trace has its own clock: every lane starts free
        free, prev_land = lanes[worker], lands.get(worker, 0.0)
        stages = [(n, c.stage(n)) for n in ("gather", *(n for n, _ in links))
                  if c.stage(n) is not None]
        idle = all(free.get(n, -np.inf) <= c.issue for n, _ in stages)
        if free.get(stages[0][0], -np.inf) <= c.issue:
            pre.append(stages[0][1][0] - c.issue)
        for i in range(1, len(stages) if not streamed else min(2, len(stages))):
            (_, (_, before_end)), (name, (start, _)) = stages[i - 1], stages[i]
            if free.get(name, -np.inf) <= before_end:
                gaps[i].append(start - before_end)
        end = max(b for _, (_, b) in stages)
        post.append(c.land - max(end, prev_land))
        if idle:
            alone.append(c)
        free.update((n, b) for n, (_, b) in stages)
        lands[worker] = c.land
    intercepts = [f.get("intercept_s") for _, f in links] or [0.0]
    latency = sum(max(0.0, median(g)) for g in gaps.values())
    latency += max(intercepts) if streamed else sum(intercepts)
    span_s = max(0.0, median(pre)) + max(0.0, median(post)) + gather.get("intercept_s")
    per_link = [f.get("per_byte_s") for _, f in links] or [0.0]
    per_byte = gather.get("per_byte_s") + (max(per_link) if streamed else sum(per_link))
    errors = [c.land - c.issue - (span_s + latency + per_byte * c.nbytes) for c in alone]
    rms = float(np.sqrt(np.mean(np.square(errors)))) if errors else 0.0
    return FixedCost(span_s, latency, rms)
