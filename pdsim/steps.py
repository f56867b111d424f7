"""A request's work on the producer: compute steps, and the spans each step makes ready.

Spans come from `pdref.plan.plan_spans` (the one span plan both shells use); this module only
decides *when* each becomes ready. whole: all after the last chunk. chunk: span k after
chunk k. layer: prefill runs layer-major (as pdgpu does): layer l over every chunk of the
suffix, then layer l's span is ready; each layer step costs 1/L of the whole prefill.
"""

from __future__ import annotations

import attrs

from pdref.events import Mode
from pdref.intervals import Range
from pdref.plan import Region, plan_chunks, plan_spans
from pdsim.config import RequestSpec, SimConfig


@attrs.frozen
class Step:
    """One piece of prefill compute: its region, its base duration, the spans ready after it."""

    layers: Range
    tokens: Range
    base_s: float
    spans: tuple[Region, ...] = ()


def plan_steps(cfg: SimConfig, request: RequestSpec) -> list[Step]:
    """The producer's steps for one request, in order (empty when prefix == prompt)."""
    chunks = plan_chunks(request.prompt, request.prefix, cfg.chunk)
    spans = plan_spans(cfg.mode, cfg.geometry, request.prompt, request.prefix, cfg.chunk)
    if not chunks:
        return []
    everything = (0, cfg.geometry.layers)
    if cfg.no_compute:
        return [Step(everything, (request.prefix, request.prompt), 0.0, tuple(spans))]
    cost = [cfg.costs.compute_s(tokens) for tokens in chunks]
    if cfg.mode is Mode.CHUNK:
        return [Step(everything, t, c, (s,)) for t, c, s in zip(chunks, cost, spans, strict=True)]
    if cfg.mode is Mode.WHOLE:
        steps = [Step(everything, t, c) for t, c in zip(chunks[:-1], cost[:-1], strict=True)]
        return steps + [Step(everything, chunks[-1], cost[-1], tuple(spans))]
    per_layer = sum(cost) / cfg.geometry.layers
    return [Step(s.layers, s.tokens, per_layer, (s,)) for s in spans]


def span_copy_s(cfg: SimConfig, nbytes: int, last: bool) -> float:
    """How long one span holds the copy worker; the last span also carries recurrent state."""
    return cfg.costs.copy_s(copied_bytes(cfg, nbytes, last))


def copied_bytes(cfg: SimConfig, nbytes: int, last: bool) -> int:
    """Bytes a span moves: its KV, plus the recurrent state when it is the request's last."""
    return nbytes + (cfg.costs.state_bytes if last else 0)
