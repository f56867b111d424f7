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

from pdref.state import Phase, RequestLife, SystemState


class MirrorLife:
    """One life, as `RequestLife` holds it; `in_flight` and `unfenced` are lists here."""

    __slots__ = ("req", "producer", "prompt", "prefix", "pages", "progress", "computed",
                 "held", "phase", "in_flight", "failed", "serial", "unfenced")

    def __init__(self, life: RequestLife) -> None:
        (self.req, self.producer, self.prompt, self.prefix, self.pages, self.progress,
         self.computed, self.held, self.phase, in_flight, self.failed, self.serial,
         unfenced) = life
        self.in_flight, self.unfenced = list(in_flight), list(unfenced)

    def frozen(self) -> RequestLife:
        """The specification's value of this life."""
        return RequestLife(self.req, self.producer, self.prompt, self.prefix, self.pages,
                           self.progress, self.computed, self.held, self.phase,
                           tuple(self.in_flight), self.failed, self.serial,
                           tuple(self.unfenced))

    def can_admit(self) -> bool:
        return (self.phase is Phase.PRODUCED and not self.in_flight and not self.failed
                and self.progress.is_complete())


class MirrorState:
    """`SystemState`'s fields, its maps as dicts (mutable: the fast monitor changes them)."""

    def __init__(self, state: SystemState) -> None:
        self.load(state)

    def load(self, state: SystemState) -> None:
        """Take every value of `state`."""
        (self.geometry, self.mode, self.max_pending, self.pool, requests, pending, used,
         self.version, self.lives, unfenced, quarantine) = state
        self.requests = {req: MirrorLife(life) for req, life in requests.items()}
        self.pending, self.spans_used = dict(pending), dict(used)
        self.unfenced, self.quarantine = dict(unfenced), dict(quarantine)

    def snapshot(self) -> SystemState:
        """The specification's value of this state (a copy: O(size))."""
        return SystemState(
            self.geometry, self.mode, self.max_pending, self.pool,
            immutables.Map({req: life.frozen() for req, life in self.requests.items()}),
            immutables.Map(self.pending), immutables.Map(self.spans_used), self.version,
            self.lives, immutables.Map(self.unfenced), immutables.Map(self.quarantine))

    @property
    def fences(self) -> bool:
        return self.version >= 2
