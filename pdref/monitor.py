"""The small imperative helper both shells drive the protocol through.

It holds the current immutable state, applies each event (an illegal one raises and leaves
the state as it was), and hands every accepted event to a sink (e.g. a TraceWriter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress, count, islice
from operator import gt, itemgetter

from pdref import events as ev
from pdref import hybrid
from pdref.apply import TRANSITIONS, apply, check_end, initial_state
from pdref.events import Stage
from pdref.rows import as_event
from pdref.state import DECODER, SystemState
from pdref.violations import Violation


class Monitor:
    """Live specification check of a run: `emit` every event as it happens."""

    def __init__(self, header: ev.Header, sink: Callable[[object], None] | None = None,
                 stage_sink: Callable[[object], None] | None = None) -> None:
        self.header = header
        self.state: SystemState = initial_state(header)
        self.sink = sink
        self.stage_sink = stage_sink if stage_sink is not None else sink
        self.events = 0
        self.last_t = 0.0

    def emit(self, event) -> None:
        """Apply `event` (or its row, pdref.rows); raises Violation (state unchanged) when it
        breaks a rule."""
        event = as_event(event)
        t = event.t
        if t < self.last_t:
            raise Violation("TRACE-2", f"t {t} is before the previous t {self.last_t}", event)
        cls = type(event)
        if cls is not Stage:  # a stage changes no state (`apply_stage`): most events
            self.state = TRANSITIONS[cls](self.state, event)  # `apply`, one call less
        self.last_t = t
        self.events += 1
        if self.sink is not None:
            self.sink(event)

    def stage(self, event: ev.Stage) -> None:
        """An informational stage reported once it ended: its `t` is its start, usually before
        protocol events emitted while it ran, so it is not ordered against them. Checked for
        form (`end >= t`, TRACE-2) and applied; handed to `stage_sink`, whose writer merges
        stages into the trace by time."""
        if event.end < event.t:
            raise Violation("TRACE-2", f"stage {event.name} ends at {event.end}, before it "
                            f"starts at {event.t}", event)
        self.state = apply(self.state, event)
        self.events += 1
        if self.stage_sink is not None:
            self.stage_sink(event)

    def recorded_stages(self, name: str, starts: Sequence[float], ends: Sequence[float]) -> None:
        """Stages a shell recorded as times instead of emitting them one by one (pdsim's
        decode steps: one per token at batch 1), which its trace writer merges by time:
        checked for form as `stage` checks one (each ends at or after it starts) and for
        order among themselves (starts never decrease), both TRACE-2; in C, not one call per
        stage.
        Counted as checked events; not handed to a sink (the shell writes them)."""
        if len(starts) != len(ends):
            raise ValueError(f"{len(starts)} stage starts but {len(ends)} ends")
        bad = _first_ending_before_start(starts, ends)
        if bad is not None:
            raise Violation("TRACE-2", f"stage {name} ends at {ends[bad]}, before it starts "
                            f"at {starts[bad]}")
        back = next(compress(count(1), map(gt, starts, islice(starts, 1, None))), None)
        if back is not None:
            raise Violation("TRACE-2", f"stage {name} starts at {starts[back]}, before the "
                            f"one recorded before it at {starts[back - 1]}")
        self.events += len(starts)

    def recorded_stage_rows(self, rows: Sequence[tuple]) -> None:
        """Stages a shell recorded as rows `(t, req, name, end, span, resource)`, in any
        order (its trace writer sorts them by time): each checked for form as `stage` checks
        one (end >= t, TRACE-2), in C, and counted; not handed to a sink."""
        bad = _first_ending_before_start(map(itemgetter(0), rows), map(itemgetter(3), rows))
        if bad is not None:
            t, req, name, end = rows[bad][:4]
            raise Violation("TRACE-2", f"stage {name} of {req!r} ends at {end}, before it "
                            f"starts at {t}")
        self.events += len(rows)

    def recorded_relative_stages(self, bases: Sequence[float], groups: Sequence[tuple]) -> None:
        """Stages a shell recorded as groups of `(name, start, end)` offsets from a base time
        (pdsim's span copies: the stages of one span, whose absolute times are `base + start`
        and `base + end`; spans of one size share one offsets tuple). Each checked for form
        as `stage` checks one (end >= start, TRACE-2) and counted; not handed to a sink.
        Each distinct offsets tuple is checked once: adding one base to a start and to an end
        not before it cannot put them out of order (floating-point addition rounds
        monotonically), so when it passes every use of it does; one that fails is refused
        even where rounding would hide it in the absolute times."""
        if len(bases) != len(groups):
            raise ValueError(f"{len(bases)} stage bases but {len(groups)} groups")
        for group in dict(zip(map(id, groups), groups, strict=True)).values():
            bad = _first_ending_before_start(map(itemgetter(1), group), map(itemgetter(2), group))
            if bad is not None:
                base = bases[next(i for i, g in enumerate(groups) if g is group)]
                name, start, end = group[bad]
                raise Violation("TRACE-2", f"stage {name} ends at {base + end}, before it "
                                f"starts at {base + start} (offsets {end} and {start} from "
                                f"{base})")
        self.events += sum(map(len, groups))

    def reserve(self, t: float, req: str, prompt: int, prefix: int, producer: str = "p0",
                state_slot=None, hit=None):
        """Allocate the lowest free pages for [prefix, prompt) and emit the reserve (v3: with
        the producer's `state_slot`, see `free_state_slot`; v4: with the decoder's cached
        pages of [0, prefix) as `hit`); page ids."""
        count = self.state.pages_needed(prompt, prefix)
        _, pages = self.state.pool.allocate(count)
        self.emit(ev.Reserve(t, req, prompt, prefix, pages, producer, state_slot, hit))
        return pages

    def cached(self, owner: str = DECODER) -> dict:
        """(v4) The pages of a prefix cache (the decoder's, or producer `owner`'s): page id ->
        CachedPage (its first token, how many hold it: evictable at 0)."""
        return dict(self.state.caches.get(owner, {}))

    def free_state_slot(self, producer: str = "p0") -> int:
        """(v3) The lowest state slot number of `producer` that no live life holds and no
        unfenced state span reads: the one a new life of a model with linear layers may
        name."""
        s = self.state
        return first_free_slot(s.geometry.layout, s.requests.values(), s.unfenced, producer)

    def can_reserve(self, prompt: int, prefix: int) -> bool:
        return self.state.can_reserve(prompt, prefix)

    def can_issue(self, producer: str = "p0") -> bool:
        return self.state.can_issue(producer)

    def can_admit(self, req: str) -> bool:
        return self.state.can_admit(req)

    def pending(self, producer: str = "p0") -> int:
        """Spans of `producer` in flight or (v2) unfenced: the slots its writers hold."""
        return self.state.pending_of(producer)

    def landing(self, req: str, span):
        """The span `span` of request `req` (pdref.state.Span) when a `land` of it now would
        be accepted; None when it would be refused (not in flight, or over landed tokens).
        Changes nothing: a shell asks before it writes the span's bytes."""
        life = self.state.live(req)
        found = life.find_span(span) if life is not None else None
        if found is None:
            return None
        try:
            apply(self.state, ev.Land(self.last_t, req, span))
        except Violation:
            return None
        return found

    def fence(self, t: float, req: str, span) -> None:
        """(v2) The writer of failed or cancelled `span` of `req` has stopped: emit the fence."""
        self.emit(ev.Fence(t, req, span))

    def unfenced(self, req: str) -> tuple:
        """Span ids of request id `req` (any of its lives) that still need a fence."""
        return self.state.unfenced_of(req)

    def free_page_ids(self) -> tuple[int, ...]:
        """The page ids the specification's pool holds free now (none quarantined)."""
        return tuple(p for a, b in self.state.pool.free for p in range(a, b))

    @property
    def free_pages(self) -> int:
        return self.state.free_pages

    @property
    def quarantined_pages(self) -> int:
        """Pages of aborted lives held until their unfenced writers are fenced."""
        return self.state.pool.quarantined_pages

    def close(self) -> None:
        """End of a complete run: LIFE-1 says nothing may still hold pages or spans."""
        check_end(self.state)


def first_free_slot(layout, lives, unfenced, producer: str) -> int:
    """The lowest integer state slot of `producer` free in the given lives and unfenced
    spans (hybrid.slot_holder)."""
    slot = 0
    while hybrid.slot_holder(layout, lives, unfenced, producer, slot) is not None:
        slot += 1
    return slot


def _first_ending_before_start(starts, ends) -> int | None:
    """The index of the first stage whose end is before its start (in C: one pass over
    hundreds of thousands of stages); None when every stage ends at or after its start."""
    return next(compress(count(), map(gt, starts, ends)), None)
