"""A request's work on the producer: compute steps, and the spans each step makes ready.

The steps and the spans each makes ready come from `pdref.plan.plan_steps` (the one schedule
both shells iterate); this module adds their base durations. whole: all after the last
chunk. chunk: span k after chunk k. layer: prefill runs layer-major (as pdgpu does): layer l
over every chunk of the suffix, then layer l's span is ready; each layer step costs 1/L of
the whole prefill.

The two-stage pipeline lower bound of one request (`lower_bound_s`): compute feeds copies,
nothing else. Stage 1 runs the compute steps back to back (no contention, never blocked);
stage 2 issues each span to the copier (serial or pipelined, pdsim/core/copier.py) as soon as
it is ready (unbounded staging). Any schedule the simulator plays is at least this long, so
handoff - bound is the cost of the max_pending bound and of contention.
"""

from __future__ import annotations

from typing import NamedTuple

from pdref import plan
from pdref.events import Mode
from pdref.intervals import Range
from pdref.plan import Region
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.copier import Copier

_new = tuple.__new__


class Step(NamedTuple):
    """One piece of prefill compute: its region, its base duration, the spans ready after it.
    (A NamedTuple: a run makes one per chunk of every request.)"""

    layers: Range
    tokens: Range
    base_s: float
    spans: tuple[Region, ...] = ()


def plan_steps(cfg: SimConfig, request: RequestSpec, memo: dict | None = None,
               start: int | None = None) -> list[Step]:
    """The producer's steps for one request (`pdref.plan.plan_steps`), with their costs.
    `memo`: a run's steps by chunk (requests share their chunks: one Step value serves all).
    `start` (where a producer's own cache hit ends): compute from it (`_spans_from`)."""
    first = request.prefix if start is None else start
    steps = plan.plan_steps(cfg.mode, cfg.geometry, request.prompt, first, cfg.chunk,
                            compute=not cfg.no_compute)
    if first != request.prefix:
        steps = _spans_from(cfg, steps, request)
    if cfg.no_compute:  # export only: the payload is written (fill), then copied
        fill = cfg.costs.fill_byte_s
        return [Step(s.layers, s.tokens, fill * _region_bytes(cfg, s), s.spans) for s in steps]
    if cfg.mode is not Mode.LAYER:  # whole and chunk modes: each step its chunk, every layer
        return _chunk_steps(cfg, steps, {} if memo is None else memo)
    chunks = plan.plan_chunks(request.prompt, first, cfg.chunk)
    per_layer = sum(cfg.costs.compute_s(t) for t in chunks) / cfg.geometry.layers
    return [Step(s.layers, s.tokens, _step_cost(cfg, s, per_layer), s.spans) for s in steps]


def _spans_from(cfg: SimConfig, steps: list[plan.Step], request: RequestSpec) -> list:
    """Steps that compute from a producer hit's end `start` (pdref's, planned from it) with
    the spans of the life's `[prefix, prompt)` instead, as pdgpu's producer sends them
    (serve/producer_cache.plan_with_hit): chunk mode, each chunk's part at or after
    `prefix` (a chunk below it computes KV the decoder holds: attention needs it, nothing
    crosses); whole and layer mode, pdref's spans of `[prefix, prompt)`, after the last
    step or each layer's. `upfront_span` is the copy of `[prefix, start)` from the hit."""
    prompt, prefix = request.prompt, request.prefix
    if cfg.mode is Mode.CHUNK:
        return [plan.Step(s.layers, s.tokens, _clipped(s.spans, prefix)) for s in steps]
    spans = plan.plan_spans(cfg.mode, cfg.geometry, prompt, prefix, cfg.chunk)
    if cfg.mode is Mode.WHOLE or cfg.no_compute:
        return [plan.Step(s.layers, s.tokens, tuple(spans) if i == len(steps) - 1 else ())
                for i, s in enumerate(steps)]
    return [plan.Step(s.layers, s.tokens, tuple(r for r in spans if r.layers == s.layers))
            for s in steps]


def _clipped(spans: tuple[Region, ...], prefix: int) -> tuple[Region, ...]:
    """Chunk spans without their tokens below `prefix` (state spans as they are); the same
    tuple when none reaches below it (pdref shares a chunk's spans: `_chunk_steps` memo)."""
    if all(r.state or r.tokens[0] >= prefix for r in spans):
        return spans
    return tuple(r if r.state or r.tokens[0] >= prefix
                 else Region(r.layers, (prefix, r.tokens[1]))
                 for r in spans if r.state or r.tokens[1] > prefix)


def upfront_span(cfg: SimConfig, request: RequestSpec, start: int) -> Region | None:
    """Chunk mode with a producer hit past the decoder's (`start` > prefix): the span of
    `[prefix, start)` copied from the hit's pages before any compute (pdgpu's `upfront`);
    else None (whole and layer mode: pdref's spans of `[prefix, prompt)` carry it)."""
    if cfg.mode is not Mode.CHUNK or start <= request.prefix:
        return None
    return Region((0, cfg.geometry.layers), (request.prefix, start))


def _chunk_steps(cfg: SimConfig, steps: list[plan.Step], memo: dict) -> list[Step]:
    """Each chunk's step, its cost `Costs.compute_s`: from `memo` (tokens -> Step) where the
    same chunk made the same spans ready (pdref.plan shares a chunk's span tuple)."""
    out = []
    for s in steps:
        tokens, spans = s.tokens, s.spans
        made = memo.get(tokens)
        if made is None or made.spans is not spans:
            made = _new(Step, (s.layers, tokens, cfg.costs.compute_s(tokens), spans))
            memo[tokens] = made
        out.append(made)
    return out


def _region_bytes(cfg: SimConfig, step: plan.Step) -> int:
    return cfg.geometry.region_bytes(step.layers, step.tokens)


def _step_cost(cfg: SimConfig, step: plan.Step, per_layer: float) -> float:
    """A step over every layer costs its chunk; a layer step 1/L of the whole prefill."""
    if step.layers == (0, cfg.geometry.layers):
        return cfg.costs.compute_s(step.tokens)
    return per_layer * (step.layers[1] - step.layers[0])


def span_copy_s(cfg: SimConfig, nbytes: int, last: bool) -> float:
    """How long one span holds the copy worker; the last span also carries recurrent state."""
    return cfg.costs.copy_s(copied_bytes(cfg, nbytes, last))


def copied_bytes(cfg: SimConfig, nbytes: int, last: bool) -> int:
    """Bytes a span moves: its KV, plus the recurrent state when it is the request's last."""
    return nbytes + (cfg.costs.state_bytes if last else 0)


def lower_bound_s(cfg: SimConfig, request: RequestSpec) -> float:
    """Earliest time (from the request's start) it could be admitted."""
    steps = plan_steps(cfg, request)
    total = sum(1 for s in steps for _ in s.spans)
    copier = Copier(cfg.costs)
    compute_end = copy_end = 0.0
    seen = 0
    for step in steps:
        compute_end += step.base_s
        for span in step.spans:
            seen += 1
            nbytes = copied_bytes(cfg, span.span_bytes(cfg.geometry, request.prompt,
                                                       request.prefix), seen == total)
            copy_end = max(copy_end, copier.schedule(compute_end, nbytes).land)
    return max(compute_end, copy_end)


def copy_total_s(cfg: SimConfig, request: RequestSpec) -> float:
    """Total time of the request's span copies, each alone (on a serial copier: the time
    its worker is busy)."""
    spans = [s for step in plan_steps(cfg, request) for s in step.spans]
    return sum(
        span_copy_s(cfg, s.span_bytes(cfg.geometry, request.prompt, request.prefix),
                    i == len(spans) - 1) for i, s in enumerate(spans)
    )
