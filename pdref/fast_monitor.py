"""`FastMonitor`: the Monitor a simulator drives, on a mutable mirror of the state.

Same interface and same verdicts as `Monitor`, about twice as fast per event; it takes the
rows of pdref.rows for the per-span events as the events themselves. Each event's
transition (mirror_apply.py) tests the specification's conditions (apply.py) and, when all
hold, changes the mirror in place (mirror.py) exactly as `apply` would change the state.
When any does not hold, nothing is changed: the specification itself (`apply` on a snapshot) gives
the verdict, so a refused event raises the very Violation, code and message `Monitor`
raises. Should the specification accept what this code turned down (a bug here, never
seen), its state is taken and `deferred_legal` counts it. tests/test_pdref_machine.py and
tests/test_pdref_fast_monitor.py drive both monitors with random legal and illegal events
and traces and compare verdicts, and `snapshot()` with the specification's state after
every event.
"""

from __future__ import annotations

from pdref import events as ev
from pdref.apply import apply, check_end, initial_state
from pdref.mirror import MirrorState
from pdref.mirror_apply import MirrorTransitions
from pdref.mirror_cache import CacheTransitions
from pdref.mirror_hybrid import HybridTransitions
from pdref.monitor import Monitor, first_free_slot
from pdref.rows import ComputedRow, IssueRow, LandRow, as_event
from pdref.state import DECODER
from pdref.violations import Violation

_new = tuple.__new__


class FastMonitor(CacheTransitions, MirrorTransitions, HybridTransitions, Monitor):
    """Live specification check of a run (see the module docstring)."""

    def __init__(self, header: ev.Header, sink=None, stage_sink=None, lean: bool = False) -> None:
        self.header = header
        # lean: span ids kept without their owners (mirror.py), for runs of any length
        self.mirror = MirrorState(initial_state(header), lean)
        self.sink = sink
        self.stage_sink = stage_sink if stage_sink is not None else sink
        self.events = 0
        self.last_t = 0.0
        self.deferred_legal = 0  # events this code refused and the specification accepted
        m = self.mirror
        self._handlers = {
            ev.Reserve: self._reserve, ev.Computed: self._computed, ev.Issue: self._issue,
            ev.Land: self._land, ev.Fail: self._fail, ev.Reuse: self._reuse,
            ev.Produced: self._produced, ev.Admit: self._admit, ev.Release: self._release,
            ev.Abort: self._abort, ev.Fence: self._fence, ev.Stage: None,
            ComputedRow: self._computed, IssueRow: self._issue, LandRow: self._land}
        self._layout = header.geometry.layout
        if self._layout is not None:  # (v3) layer kinds: mirror_hybrid.py's transitions
            self._handlers.update({
                ev.Reserve: self._reserve_h, ev.Computed: self._computed_h,
                ev.Issue: self._issue_h, ev.Land: self._land_h, ev.Admit: self._admit_h,
                ComputedRow: self._computed_h, IssueRow: self._issue, LandRow: self._land_h})
        self._handlers.update(self.cache_handlers(header.version))  # (v4) mirror_cache.py
        self._requests, self._pending, self._used = m.requests, m.pending, m.spans_used
        self._token_layer_bytes = header.geometry.bytes_per_token_layer

    @property
    def state(self):
        """The specification's value of the current state (a copy: O(size))."""
        return self.mirror.snapshot()

    def emit(self, event) -> None:
        """Apply `event`; raises Violation (state unchanged) when it breaks a rule."""
        t = event.t
        if t < self.last_t:
            raise Violation("TRACE-2", f"t {t} is before the previous t {self.last_t}",
                            as_event(event))
        handler = self._handlers[type(event)]
        if handler is not None and not handler(event):  # (a stage changes nothing)
            self._by_spec(event)
        self.last_t = t
        self.events += 1
        if self.sink is not None:
            self.sink(event)

    def stage(self, event: ev.Stage) -> None:
        if event.end < event.t:
            raise Violation("TRACE-2", f"stage {event.name} ends at {event.end}, before it "
                            f"starts at {event.t}", event)
        self.events += 1
        if self.stage_sink is not None:
            self.stage_sink(event)

    def _by_spec(self, event) -> None:
        """The specification's verdict on an event this code turned down."""
        state = apply(self.mirror.snapshot(), as_event(event))  # raises Monitor's Violation
        self.deferred_legal += 1
        self._reload(state)

    def _reload(self, state) -> None:
        m = self.mirror
        m.load(state)
        self._requests, self._pending, self._used = m.requests, m.pending, m.spans_used

    # -- the queries shells drive the protocol with ----------------------------------------------

    def reserve(self, t: float, req: str, prompt: int, prefix: int, producer: str = "p0",
                state_slot=None, hit=None):
        m = self.mirror
        _, pages = m.pool.allocate(m.geometry.pages_for(prompt - prefix))
        self.emit(ev.Reserve(t, req, prompt, prefix, pages, producer, state_slot, hit))
        return pages

    def cached(self, owner: str = DECODER) -> dict:
        return dict(self.mirror.caches.get(owner, {}))

    def free_state_slot(self, producer: str = "p0") -> int:
        return first_free_slot(self._layout, self._requests.values(), self.mirror.unfenced,
                               producer)

    def can_reserve(self, prompt: int, prefix: int) -> bool:
        m = self.mirror
        return m.geometry.pages_for(prompt - prefix) <= m.pool.free_pages

    def can_issue(self, producer: str = "p0") -> bool:
        return self._pending.get(producer, 0) < self.mirror.max_pending

    def can_admit(self, req: str) -> bool:
        life = self._requests.get(req)
        if life is None:
            return False
        return life.can_admit() if self._layout is None else self._hybrid_ready(life)

    def pending(self, producer: str = "p0") -> int:
        return self._pending.get(producer, 0)

    def landing(self, req: str, span):
        life = self._requests.get(req)
        index = None if life is None else self._span_index(life, span)
        if index is None:
            return None
        found = life.in_flight[index]
        return found if self._lands(life, found) else None

    def unfenced(self, req: str) -> tuple:
        return tuple(span for span, u in self.mirror.unfenced.items() if u.req == req)

    def free_page_ids(self) -> tuple[int, ...]:
        return tuple(p for a, b in self.mirror.pool.free for p in range(a, b))

    @property
    def free_pages(self) -> int:
        return self.mirror.pool.free_pages

    @property
    def quarantined_pages(self) -> int:
        return self.mirror.pool.quarantined_pages

    def close(self) -> None:
        m = self.mirror
        if m.unfenced or any(life.pages or life.in_flight for life in m.requests.values()):
            check_end(m.snapshot())  # LIFE-1: the specification words it
