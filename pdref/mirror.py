"""A mutable mirror of `SystemState` for the fast monitor (fast_monitor.py).

The specification's state is immutable: every event builds a new life and a new state, and
its maps are persistent (HAMT) maps. A simulator checking millions of events pays for that
on every one. The mirror holds the same values in plain dicts and mutable lives, so a legal
event changes a few fields in place. It converts both ways (`snapshot`, `MirrorState.load`):
the tests compare `snapshot()` with the specification's state after every event, and the
monitor hands the specification a snapshot whenever it must give a verdict itself.
"""

from __future__ import annotations

import immutables

from pdref.intervals import IntervalSet
from pdref.progress import Coverage, LayerProgress, empty_coverage
from pdref.span_ids import UsedSpanIds
from pdref.state import Phase, RequestLife, SystemState

_NO_STATES = IntervalSet()  # (v3) a new life's landed states: none


def band(num_layers: int, lo: int, hi: int) -> Coverage:
    """The coverage of tokens [lo, hi) on every layer (empty when lo >= hi), as the
    specification's unions build it."""
    if lo >= hi:
        return empty_coverage(num_layers)
    return Coverage(num_layers, (0,), (IntervalSet((lo,), (hi,)),))


def band_covers(lo: int, hi: int, a: int, b: int) -> bool:
    """Whether the band [lo, hi) holds every token of [a, b) (an empty range: always)."""
    return b <= a or (lo <= a and b <= hi)


class MirrorLife:
    """One life, as `RequestLife` holds it; `in_flight` and `unfenced` are lists here.

    A chunk-mode life (every span and step over all layers, in token order) covers one band
    of tokens on every layer, so its coverages are held as two integers until anything else
    happens (`computed` / `progress` None: the band [c_lo, c_hi) / [p_lo, p_hi)); then as
    the specification's values. `held` None: the same value as `computed` (in the
    specification, the same object until the first reuse)."""

    __slots__ = ("req", "producer", "prompt", "prefix", "pages", "progress", "computed",
                 "held", "phase", "in_flight", "failed", "serial", "unfenced", "state_slot",
                 "states", "refs", "layers", "c_lo", "c_hi", "p_lo", "p_hi", "finished")

    def __init__(self, life: RequestLife) -> None:
        (self.req, self.producer, self.prompt, self.prefix, self.pages, self.progress,
         self.computed, held, self.phase, in_flight, self.failed, self.serial,
         unfenced, self.state_slot, self.states, self.refs) = life
        self.held = None if held is self.computed else held
        self.in_flight, self.unfenced = list(in_flight), list(unfenced)
        self.layers = self.progress.num_layers
        self.c_lo = self.c_hi = self.p_lo = self.p_hi = 0
        self.finished = False

    @classmethod
    def reserved(cls, req: str, producer: str, prompt: int, prefix: int, pages, layers: int,
                 serial: int, state_slot=None) -> MirrorLife:
        """A new life: nothing computed, held or landed (all three as empty bands)."""
        life = cls.__new__(cls)
        life.req, life.producer, life.prompt, life.prefix, life.pages = (req, producer, prompt,
                                                                         prefix, pages)
        life.state_slot, life.states, life.refs = state_slot, _NO_STATES, None
        life.progress = life.computed = life.held = None
        life.phase, life.in_flight, life.failed, life.serial = Phase.RESERVED, [], False, serial
        life.unfenced, life.layers = [], layers
        life.c_lo = life.c_hi = life.p_lo = life.p_hi = 0
        life.finished = False
        return life

    def computed_value(self) -> Coverage:
        if self.computed is None:
            return band(self.layers, self.c_lo, self.c_hi)
        return self.computed

    def own_computed(self) -> Coverage:
        """`computed` as the specification's value from now on."""
        if self.computed is None:
            self.computed = band(self.layers, self.c_lo, self.c_hi)
        return self.computed

    def held_value(self) -> Coverage:
        return self.computed_value() if self.held is None else self.held

    def progress_value(self) -> LayerProgress:
        if self.progress is None:
            return LayerProgress(self.layers, self.prefix, self.prompt,
                                 band(self.layers, self.p_lo, self.p_hi), self.finished)
        return self.progress

    def own_progress(self) -> LayerProgress:
        """`progress` as the specification's value from now on."""
        if self.progress is None:
            self.progress = self.progress_value()
        return self.progress

    def frozen(self) -> RequestLife:
        """The specification's value of this life."""
        computed = self.computed_value()
        return RequestLife(self.req, self.producer, self.prompt, self.prefix, self.pages,
                           self.progress_value(), computed,
                           computed if self.held is None else self.held, self.phase,
                           tuple(self.in_flight), self.failed, self.serial,
                           tuple(self.unfenced), self.state_slot, self.states, self.refs)

    def complete(self) -> bool:
        """Every layer landed every suffix token (`LayerProgress.is_complete`)."""
        if self.progress is not None:
            return self.progress.is_complete()
        return band_covers(self.p_lo, self.p_hi, self.prefix, self.prompt)

    def can_admit(self) -> bool:
        return (self.phase is Phase.PRODUCED and not self.in_flight and not self.failed
                and self.complete())


class MirrorState:
    """`SystemState`'s fields, its maps as dicts (mutable: the fast monitor changes them).
    `lean`: the used span ids as `UsedSpanIds` (integer ids without their owners), so that
    a long run's state holds what is in flight, not every span it ever issued."""

    def __init__(self, state: SystemState, lean: bool = False) -> None:
        self.lean = lean
        self.load(state)

    def load(self, state: SystemState) -> None:
        """Take every value of `state`."""
        (self.geometry, self.mode, self.max_pending, self.pool, requests, pending, used,
         self.version, self.lives, unfenced, quarantine, caches) = state
        self.requests = {req: MirrorLife(life) for req, life in requests.items()}
        self.pending = dict(pending)
        self.spans_used = UsedSpanIds(used.items()) if self.lean else dict(used)
        self.unfenced, self.quarantine = dict(unfenced), dict(quarantine)
        self.caches = {owner: dict(pages) for owner, pages in caches.items()}  # (v4)

    def snapshot(self) -> SystemState:
        """The specification's value of this state (a copy: O(size))."""
        return SystemState(
            self.geometry, self.mode, self.max_pending, self.pool,
            immutables.Map({req: life.frozen() for req, life in self.requests.items()}),
            immutables.Map(self.pending), immutables.Map(self.spans_used.items()), self.version,
            self.lives, immutables.Map(self.unfenced), immutables.Map(self.quarantine),
            immutables.Map({owner: immutables.Map(pages) for owner, pages in self.caches.items()}))

    @property
    def fences(self) -> bool:
        return self.version >= 2
