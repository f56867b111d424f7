"""`FastMonitor`: the Monitor a simulator drives, on a mutable mirror of the state.

Same interface and same verdicts as `Monitor`, about twice as fast per event. Each event's
transition here tests the specification's conditions (apply.py) and, when all hold, changes
the mirror in place (mirror.py) exactly as `apply` would change the state. When any does
not hold, nothing is changed here: the specification itself (`apply` on a snapshot) gives
the verdict, so a refused event raises the very Violation, code and message `Monitor`
raises. Should the specification accept what this code turned down (a bug here, never
seen), its state is taken and `deferred_legal` counts it. tests/test_pdref_fast_monitor.py
drives both monitors with random legal and illegal traces and compares verdicts and
`snapshot()` with the specification's state after every event.
"""

from __future__ import annotations

from pdref import events as ev
from pdref.apply import apply, check_end, initial_state
from pdref.mirror import MirrorLife, MirrorState
from pdref.monitor import Monitor
from pdref.pool import PoolError
from pdref.progress import ProgressError
from pdref.state import Phase, Quarantine, Span, Unfenced
from pdref.violations import Violation

_new = tuple.__new__


class FastMonitor(Monitor):
    """Live specification check of a run (see the module docstring)."""

    def __init__(self, header: ev.Header, sink=None, stage_sink=None) -> None:
        self.header = header
        self.mirror = MirrorState(initial_state(header))
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
            ev.Abort: self._abort, ev.Fence: self._fence, ev.Stage: None}
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
            raise Violation("TRACE-2", f"t {t} is before the previous t {self.last_t}", event)
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
        state = apply(self.mirror.snapshot(), event)  # raises the Violation, as Monitor's
        self.deferred_legal += 1
        self._reload(state)

    def _reload(self, state) -> None:
        m = self.mirror
        m.load(state)
        self._requests, self._pending, self._used = m.requests, m.pending, m.spans_used

    # -- the transitions: True when applied, False to let the specification decide --------------

    def _reserve(self, e) -> bool:
        m = self.mirror
        page_tokens = m.geometry.page_tokens
        if (e.req in self._requests or e.prompt < 1 or not 0 <= e.prefix <= e.prompt
                or e.prefix % page_tokens
                or len(e.pages) != m.geometry.pages_for(e.prompt - e.prefix)):
            return False
        try:
            pool = m.pool.take(e.pages)
        except PoolError:
            return False
        self._requests[e.req] = MirrorLife.reserved(e.req, e.producer, e.prompt, e.prefix,
                                                    e.pages, m.geometry.layers, m.lives)
        m.pool, m.lives = pool, m.lives + 1
        return True

    def _computed(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None:
            return False
        layers, tokens = e.layers, e.tokens
        (l0, l1), (a, b) = layers, tokens
        if not ((l1 <= l0 or (0 <= l0 and l1 <= self.mirror.geometry.layers))
                and (b <= a or (0 <= a and b <= life.prompt))):
            return False
        if l1 <= l0 or b <= a:  # an empty region changes nothing
            return True
        if life.held is not None:  # held apart from computed since a reuse
            life.held = life.held.union(layers, tokens)
        if life.computed is None and l0 <= 0 and l1 >= life.layers:  # one band: extend it
            lo, hi = life.c_lo, life.c_hi
            if lo == hi:
                life.c_lo, life.c_hi = a, b
                return True
            if a <= hi and lo <= b:  # overlapping or adjacent: still one band
                life.c_lo, life.c_hi = min(lo, a), max(hi, b)
                return True
        life.computed = life.own_computed().union(layers, tokens)
        return True

    def _issue(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None or e.span in self._used:
            return False
        m = self.mirror
        geometry, layers, tokens = m.geometry, e.layers, e.tokens
        (l0, l1), (a, b) = layers, tokens
        if not ((l1 <= l0 or (0 <= l0 and l1 <= geometry.layers))
                and (b <= a or (life.prefix <= a and b <= life.prompt))):
            return False
        if e.bytes != (self._token_layer_bytes * (l1 - l0 if l1 > l0 else 0)
                       * (b - a if b > a else 0)):
            return False
        if l0 < l1 and a < b:  # an empty region reads nothing
            if life.held is None and life.computed is None:  # the computed band
                if not (life.c_lo <= a and b <= life.c_hi and life.c_lo < life.c_hi):
                    return False
            elif life.held_value().first_gap(layers, tokens) is not None:
                return False
        for other in life.in_flight:
            (o0, o1), (x, y) = other.layers, other.tokens
            if l0 < o1 and o0 < l1 and l0 < l1 and o0 < o1 and a < y and x < b and a < b and x < y:
                return False
        count = self._pending.get(life.producer, 0)
        if count >= m.max_pending:
            return False
        life.in_flight.append(_new(Span, (e.span, layers, tokens, e.bytes)))
        self._pending[life.producer] = count + 1
        self._used[e.span] = e.req
        return True

    def _take_span(self, life: MirrorLife, span_id) -> Span | None:
        """Remove span `span_id` from the life's spans in flight; None when not there."""
        in_flight = life.in_flight
        for i, span in enumerate(in_flight):
            if span.span == span_id:
                del in_flight[i]
                return span
        return None

    def _land(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None or not life.in_flight:
            return False
        in_flight = life.in_flight
        if in_flight[0].span == e.span:  # the usual order: the oldest lands first
            index, span = 0, in_flight[0]
        else:
            index, span = next(((i, s) for i, s in enumerate(in_flight) if s.span == e.span),
                               (None, None))
            if span is None:
                return False
        (l0, l1), (a, b) = span.layers, span.tokens
        if l0 < l1 and a < b and not self._publish(life, span):
            return False
        del in_flight[index]
        self._pending[life.producer] = self._pending.get(life.producer, 0) - 1
        return True

    def _publish(self, life: MirrorLife, span: Span) -> bool:
        """`LayerProgress.add` of a non-empty span: False where it raises."""
        (l0, l1), (a, b) = span.layers, span.tokens
        if life.progress is None and not life.finished and l0 <= 0 and l1 >= life.layers:
            lo, hi = life.p_lo, life.p_hi
            if lo < hi and a < hi and lo < b:  # overlaps what landed
                return False
            if life.prefix <= a and b <= life.prompt:  # else: add's own error below
                if lo == hi:
                    life.p_lo, life.p_hi = a, b
                    return True
                if a == hi or b == lo:  # adjacent: still one band
                    life.p_lo, life.p_hi = min(lo, a), max(hi, b)
                    return True
        try:
            life.progress = life.own_progress().add(span.layers, span.tokens)
        except ProgressError:
            return False
        return True

    def _fail(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None:
            return False
        span = self._take_span(life, e.span)
        if span is None:
            return False
        life.failed = True
        if not self.mirror.fences:  # v1: the span's slot is free at once
            self._pending[life.producer] = self._pending.get(life.producer, 0) - 1
            return True
        life.unfenced.append(span)
        self.mirror.unfenced[span.span] = Unfenced(span, life.req, life.producer, life.serial)
        return True

    def _reuse(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None or any(s.reads(e.tokens) for s in life.in_flight + life.unfenced):
            return False
        if e.tokens[0] < e.tokens[1]:  # (an empty range leaves held as it is)
            life.held = life.held_value().remove_tokens(e.tokens)
        return True

    def _produced(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None or life.phase is not Phase.RESERVED:
            return False
        if life.computed is None:
            if life.prefix < life.prompt and not (life.c_lo <= life.prefix
                                                  and life.prompt <= life.c_hi):
                return False
        elif life.computed.first_gap((0, life.layers), (life.prefix, life.prompt)) is not None:
            return False
        life.phase = Phase.PRODUCED
        return True

    def _admit(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None or not life.can_admit():
            return False
        life.phase = Phase.ADMITTED
        if life.progress is None:
            life.finished = True
        else:
            life.progress = life.progress.finish()
        return True

    def _release(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None or life.phase is not Phase.ADMITTED:
            return False
        self._end_life(life)
        return True

    def _abort(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None:
            return False
        self._end_life(life)
        return True

    def _end_life(self, life: MirrorLife) -> None:
        m = self.mirror
        del self._requests[life.req]
        if not m.fences:
            if life.in_flight:  # abort cancels them
                self._pending[life.producer] = (self._pending.get(life.producer, 0)
                                                - len(life.in_flight))
            m.pool = m.pool.give_back(life.pages)
            return
        writers = len(life.unfenced) + len(life.in_flight)
        if not writers:
            m.pool = m.pool.give_back(life.pages)
            return
        for span in life.in_flight:
            m.unfenced[span.span] = Unfenced(span, life.req, life.producer, life.serial)
        m.quarantine[life.serial] = Quarantine(life.req, life.pages, writers)
        m.pool = m.pool.quarantine(life.pages)

    def _fence(self, e) -> bool:
        m = self.mirror
        ended = m.unfenced.get(e.span)
        if ended is None or ended.req != e.req:
            return False
        del m.unfenced[e.span]
        self._pending[ended.producer] = self._pending.get(ended.producer, 0) - 1
        life = self._requests.get(e.req)
        if life is not None and life.serial == ended.life:
            life.unfenced = [s for s in life.unfenced if s.span != e.span]
            return True
        held = m.quarantine[ended.life]
        if held.unfenced > 1:
            m.quarantine[ended.life] = Quarantine(held.req, held.pages, held.unfenced - 1)
        else:
            del m.quarantine[ended.life]
            m.pool = m.pool.unquarantine(held.pages)
        return True

    # -- the queries shells drive the protocol with ----------------------------------------------

    def reserve(self, t: float, req: str, prompt: int, prefix: int, producer: str = "p0"):
        m = self.mirror
        _, pages = m.pool.allocate(m.geometry.pages_for(prompt - prefix))
        self.emit(ev.Reserve(t, req, prompt, prefix, pages, producer))
        return pages

    def can_reserve(self, prompt: int, prefix: int) -> bool:
        m = self.mirror
        return m.geometry.pages_for(prompt - prefix) <= m.pool.free_pages

    def can_issue(self, producer: str = "p0") -> bool:
        return self._pending.get(producer, 0) < self.mirror.max_pending

    def can_admit(self, req: str) -> bool:
        life = self._requests.get(req)
        return life is not None and life.can_admit()

    def pending(self, producer: str = "p0") -> int:
        return self._pending.get(producer, 0)

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
