"""The span plan of each mode (which regions are sent, in what order) and the step schedule
(which compute steps run, and the spans each makes ready). Both shells iterate these."""

from __future__ import annotations

from itertools import chain

import attrs

from pdref.events import Mode
from pdref.geometry import Geometry
from pdref.intervals import Range, fmt


@attrs.frozen
class Region:
    """A block of KV: layers x tokens, both half-open."""

    layers: Range
    tokens: Range

    def bytes(self, geometry: Geometry) -> int:
        return geometry.region_bytes(self.layers, self.tokens)

    def __str__(self) -> str:
        return f"{fmt(self.layers)} x {fmt(self.tokens)}"


class PlanError(ValueError):
    """A workload the plan cannot be made for; the message names the field and the rule."""


def validate_workload(prompt: int, prefix: int, chunk: int, page_tokens: int) -> None:
    """Raise PlanError for a workload that breaks a rule (the shells' bad-input checks)."""
    if prompt < 1:
        raise PlanError(f"prompt must be >= 1, got {prompt}")
    if chunk < 1:
        raise PlanError(f"chunk must be >= 1, got {chunk}")
    if not 0 <= prefix <= prompt:
        raise PlanError(f"prefix must be in [0, prompt={prompt}], got {prefix}")
    if prefix % page_tokens:
        raise PlanError(f"prefix must be a multiple of page_tokens={page_tokens}, got {prefix}")


def plan_chunks(prompt: int, prefix: int, chunk: int) -> list[Range]:
    """The prefill chunks of the suffix [prefix, prompt), in order, aligned at prefix."""
    if chunk < 1:
        raise PlanError(f"chunk must be >= 1, got {chunk}")
    # (a, min(a + chunk, prompt)) for each start a, built in C; no start: no chunk
    starts = range(prefix, prompt, chunk)
    return list(zip(starts, chain(starts[1:], (prompt,)), strict=False))


def plan_spans(mode: Mode, geometry: Geometry, prompt: int, prefix: int, chunk: int):
    """The copy spans of a mode, in issue order; empty when the suffix is empty.

    whole: one span, every layer of the suffix. chunk: one span per prefill chunk, every
    layer. layer: one span per layer over the whole suffix (refused for recurrent models).
    """
    mode = Mode(mode)
    suffix = (prefix, prompt)
    all_layers = (0, geometry.layers)
    if prompt <= prefix:
        return []
    if mode is Mode.WHOLE:
        return [Region(all_layers, suffix)]
    if mode is Mode.CHUNK:
        return [Region(all_layers, tokens) for tokens in plan_chunks(prompt, prefix, chunk)]
    if geometry.recurrent:
        raise PlanError("mode layer is refused for a recurrent model (CFG-1)")
    return [Region((layer, layer + 1), suffix) for layer in range(geometry.layers)]


@attrs.frozen
class Step:
    """One compute step of a request's prefill: the region it computes, and the spans that
    are ready to issue once it is done (their regions are computed by then)."""

    layers: Range
    tokens: Range
    spans: tuple[Region, ...] = ()


def plan_steps(mode: Mode, geometry: Geometry, prompt: int, prefix: int, chunk: int,
               compute: bool = True) -> list[Step]:
    """The producer's steps for one request, in order; empty when the suffix is empty.

    whole: one step per chunk (every layer), the whole span ready after the last. chunk: one
    step per chunk, its span ready after it. layer: layer-major prefill, one step per layer
    over the whole suffix, its span ready after it. `compute=False` (export only): one step
    that fills the whole suffix at once and makes every span of the mode ready.
    """
    mode = Mode(mode)
    chunks = plan_chunks(prompt, prefix, chunk)
    every = (0, geometry.layers)
    if not chunks:
        return []
    if mode is Mode.CHUNK and compute:
        return [_chunk_step(every, t) for t in chunks]
    spans = plan_spans(mode, geometry, prompt, prefix, chunk)
    if not compute:
        return [Step(every, (prefix, prompt), tuple(spans))]
    if mode is Mode.WHOLE:
        return [Step(every, t) for t in chunks[:-1]] + [Step(every, chunks[-1], tuple(spans))]
    return [Step(s.layers, s.tokens, (s,)) for s in spans]


# A chunk's step is the same immutable value in every request that has that chunk (every
# request without a prefix shares its full chunks): made once, shared. Bounded, like
# progress.py's unions.
_CHUNK_STEPS: dict[tuple[Range, Range], Step] = {}
_CHUNK_STEPS_MAX = 8192


def _chunk_step(every: Range, tokens: Range) -> Step:
    """Chunk mode's step for one chunk: it computes the chunk and its span is ready."""
    key = (every, tokens)
    step = _CHUNK_STEPS.get(key)
    if step is None:
        if len(_CHUNK_STEPS) >= _CHUNK_STEPS_MAX:
            _CHUNK_STEPS.clear()
        step = _CHUNK_STEPS[key] = Step(every, tokens, (Region(every, tokens),))
    return step
