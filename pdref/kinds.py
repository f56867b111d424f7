"""(v3) Layer kinds of a hybrid model: what each layer hands the decoder.

A `full` layer carries the KV of every suffix token; a `sliding` layer (window W) only the
tokens its first decode step attends, from the page that holds the first of them; a
`linear` (recurrent) layer no per-token KV at all but one state of `state_bytes` bytes,
which is right only once the layer consumed the whole prompt (specs/contract.md, v3).
`Layout` groups equal consecutive layers into runs, so a span over many layers costs the
runs it meets, not the layer count.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from pdref.intervals import IntervalSet, Range

FULL, SLIDING, LINEAR = "full", "sliding", "linear"


def _kind_ok(inst: LayerKind, _attribute, _value) -> None:
    if inst.kind not in (FULL, SLIDING, LINEAR):
        raise ValueError(f"layer kind must be full, sliding or linear, got {inst.kind!r}")
    wants = {FULL: (), SLIDING: ("window",), LINEAR: ("state_bytes",)}[inst.kind]
    for name in ("window", "state_bytes"):
        value = getattr(inst, name)
        if name in wants and (type(value) is not int or value < 1):
            raise ValueError(f"a {inst.kind} layer needs {name} >= 1, got {value!r}")
        if name not in wants and value is not None:
            raise ValueError(f"a {inst.kind} layer takes no {name}")


@attrs.frozen
class LayerKind:
    """One layer's kind: `full`, `sliding` (with its window in tokens) or `linear` (with its
    state's size in bytes)."""

    kind: str = attrs.field(validator=_kind_ok)
    window: int | None = None
    state_bytes: int | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


def window_range(window: int, prompt: int, prefix: int, page_tokens: int) -> Range:
    """The suffix tokens a sliding layer of `window` carries and needs before admission.

    The first decode step (position `prompt`) attends the last `window` positions, itself
    included: prompt tokens from `prompt - window + 1`, taken from the start of their page
    so the decoder keeps whole pages; never below `prefix` (those are in its prefix cache)."""
    first = max(0, prompt - window + 1)
    return (max(prefix, first - first % page_tokens), prompt)


class Run(NamedTuple):
    """Layers [lo, hi), all of one kind."""

    lo: int
    hi: int
    kind: LayerKind


class Layout:
    """A geometry's layer kinds as runs of equal layers, and the per-kind questions the
    protocol asks of a region."""

    __slots__ = ("runs", "linear", "num_layers")

    def __init__(self, kinds: tuple[LayerKind, ...]) -> None:
        runs: list[Run] = []
        for layer, kind in enumerate(kinds):
            if runs and runs[-1].kind == kind:
                runs[-1] = Run(runs[-1].lo, layer + 1, kind)
            else:
                runs.append(Run(layer, layer + 1, kind))
        self.runs = tuple(runs)
        self.num_layers = len(kinds)
        self.linear = IntervalSet.of(*((r.lo, r.hi) for r in runs if r.kind.kind == LINEAR))

    def _meets(self, layers: Range):
        """(run, how many of its layers lie in `layers`) for every run `layers` meets."""
        l0, l1 = layers
        for run in self.runs:
            n = min(run.hi, l1) - max(run.lo, l0)
            if n > 0:
                yield run, n

    def kv_cells(self, layers: Range, tokens: Range, prompt: int, prefix: int,
                 page_tokens: int, clip: bool = True) -> int:
        """(layer, token) cells of KV a span over the region carries: every token on a full
        layer, on a sliding layer only those inside its window (all of them when `clip` is
        False: what a writer that forgot the window moves), none on a linear layer."""
        a, b = tokens
        if b <= a:
            return 0
        cells = 0
        for run, n in self._meets(layers):
            kind = run.kind
            if kind.kind == FULL or (kind.kind == SLIDING and not clip):
                cells += n * (b - a)
            elif kind.kind == SLIDING:
                lo, hi = window_range(kind.window, prompt, prefix, page_tokens)
                cells += n * max(0, min(b, hi) - max(a, lo))
        return cells

    def state_bytes(self, layers: Range) -> int:
        """Bytes of the states of the linear layers in `layers`."""
        return sum(n * run.kind.state_bytes for run, n in self._meets(layers)
                   if run.kind.kind == LINEAR)

    def all_linear(self, layers: Range) -> bool:
        """True when `layers` is non-empty and every layer of it is linear."""
        return layers[0] < layers[1] and self.linear.covers(layers)

    def writes_linear(self, layers: Range) -> Range | None:
        """The first run of linear layers inside `layers` (a region computed there writes
        their state), or None."""
        for run, _ in self._meets(layers):
            if run.kind.kind == LINEAR:
                return (max(run.lo, layers[0]), min(run.hi, layers[1]))
        return None

    def first_gap(self, landed, prompt: int, prefix: int, page_tokens: int):
        """(layer, tokens) of the first KV a decoder still needs before admission, given
        `landed` (a Coverage): every suffix token of a full layer, the window of a sliding
        one; None when nothing is missing."""
        for run in self.runs:
            kind = run.kind
            if kind.kind == LINEAR:
                continue
            need = ((prefix, prompt) if kind.kind == FULL
                    else window_range(kind.window, prompt, prefix, page_tokens))
            gap = landed.first_gap((run.lo, run.hi), need)
            if gap is not None:
                return gap
        return None

    def window_starts(self, prompt: int, prefix: int, page_tokens: int) -> list[int]:
        """(v4) Where each sliding layer's window starts (`window_range`), one per run."""
        return [window_range(r.kind.window, prompt, prefix, page_tokens)[0]
                for r in self.runs if r.kind.kind == SLIDING]

    def runs_of(self, kind: str) -> list[tuple[int, int]]:
        """(v4) The runs of layers of one kind, as layer ranges."""
        return [(r.lo, r.hi) for r in self.runs if r.kind.kind == kind]

    def missing_state(self, states: IntervalSet) -> int | None:
        """The first linear layer whose state has not landed, or None."""
        for lo, hi in self.linear:
            gap = states.first_gap((lo, hi))
            if gap is not None:
                return gap[0]
        return None
