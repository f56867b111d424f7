"""The span plan of each mode (which regions are sent, in what order) and the step schedule
(which compute steps run, and the spans each makes ready). Both shells iterate these."""

from __future__ import annotations

from itertools import chain

import attrs

from pdref.events import Mode
from pdref.geometry import Geometry
from pdref.intervals import Range, fmt
from pdref.kinds import FULL, LINEAR, window_range


@attrs.frozen
class Region:
    """A block of KV: layers x tokens, both half-open; (v3) with `state`, the recurrent
    state of its (linear) layers at position tokens[0] (`tokens` is then empty)."""

    layers: Range
    tokens: Range
    state: bool = False

    def bytes(self, geometry: Geometry) -> int:
        """Its bytes in a geometry without layer kinds (see `span_bytes`)."""
        return geometry.region_bytes(self.layers, self.tokens)

    def span_bytes(self, geometry: Geometry, prompt: int, prefix: int) -> int:
        """The bytes a span of it moves for a request of `prompt` tokens, `prefix` cached:
        per layer kind (v3), a state span its layers' state."""
        if self.state:
            return geometry.state_bytes(self.layers)
        return geometry.span_bytes(self.layers, self.tokens, prompt, prefix)

    def __str__(self) -> str:
        what = "state of " if self.state else ""
        return f"{what}{fmt(self.layers)} x {fmt(self.tokens)}"


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
    """The copy spans of a mode, in issue order; empty when the suffix is empty (v3: no KV,
    and still the states of a hybrid's linear layers).

    whole: one span, every layer of the suffix. chunk: one span per prefill chunk, every
    layer. layer: one span per layer over the whole suffix (refused for recurrent models
    that name no layer kinds). (v3, a geometry with kinds) whole and chunk: then a state
    span per run of linear layers, after the last chunk; layer: per layer, a linear layer's
    state, a sliding layer's window, a full layer's suffix.
    """
    mode = Mode(mode)
    suffix = (prefix, prompt)
    all_layers = (0, geometry.layers)
    if geometry.layout is not None:
        return _hybrid_spans(mode, geometry, prompt, prefix, chunk)
    if prompt <= prefix:
        return []
    if mode is Mode.WHOLE:
        return [Region(all_layers, suffix)]
    if mode is Mode.CHUNK:
        return [Region(all_layers, tokens) for tokens in plan_chunks(prompt, prefix, chunk)]
    if geometry.recurrent:
        raise PlanError("mode layer is refused for a recurrent model that names no layer "
                        "kinds (CFG-1)")
    return [Region((layer, layer + 1), suffix) for layer in range(geometry.layers)]


def _hybrid_spans(mode: Mode, geometry: Geometry, prompt: int, prefix: int, chunk: int):
    """`plan_spans` of a geometry with layer kinds (contract v3)."""
    at = (prompt, prompt)
    if mode is Mode.LAYER:
        out = []
        for run in geometry.layout.runs:
            for layer in range(run.lo, run.hi):
                out.append(_layer_span(run.kind, layer, geometry, prompt, prefix))
        return [r for r in out if r is not None]
    kv = [] if prompt <= prefix else (
        [Region((0, geometry.layers), (prefix, prompt))] if mode is Mode.WHOLE
        else [Region((0, geometry.layers), t) for t in plan_chunks(prompt, prefix, chunk)])
    return kv + [Region(r, at, True) for r in geometry.layout.linear]


def _layer_span(kind, layer: int, geometry: Geometry, prompt: int, prefix: int):
    """Layer mode's span of one layer (None: it carries nothing)."""
    layers = (layer, layer + 1)
    if kind.kind == LINEAR:
        return Region(layers, (prompt, prompt), True)
    tokens = ((prefix, prompt) if kind.kind == FULL
              else window_range(kind.window, prompt, prefix, geometry.page_tokens))
    return Region(layers, tokens) if tokens[0] < tokens[1] else None


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
    if geometry.layout is not None:
        return _hybrid_steps(mode, geometry, prompt, prefix, chunk, compute)
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


def _hybrid_steps(mode: Mode, geometry: Geometry, prompt: int, prefix: int, chunk: int,
                  compute: bool) -> list[Step]:
    """`plan_steps` of a geometry with layer kinds (v3): a linear layer's state is ready
    only after the step that computes its last token (state spans come last in whole and
    chunk mode; in layer mode each layer's step computes the whole suffix). An empty suffix
    still has one (empty) step: it makes the states ready (the prefix's snapshot)."""
    every, suffix = (0, geometry.layers), (prefix, prompt)
    chunks = plan_chunks(prompt, prefix, chunk) or [suffix]
    spans = plan_spans(mode, geometry, prompt, prefix, chunk)
    if not compute:
        return [Step(every, suffix, tuple(spans))]
    if mode is Mode.LAYER:
        return [Step((layer, layer + 1), suffix,
                     tuple(s for s in spans if s.layers == (layer, layer + 1)))
                for layer in range(geometry.layers)]
    states = tuple(s for s in spans if s.state)
    if mode is Mode.WHOLE:
        kv = tuple(s for s in spans if not s.state)
        return [Step(every, t) for t in chunks[:-1]] + [Step(every, chunks[-1], kv + states)]
    steps = [Step(every, t, (Region(every, t),)) for t in chunks]
    last = steps[-1]
    return steps[:-1] + [Step(last.layers, last.tokens, last.spans + states)]


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
