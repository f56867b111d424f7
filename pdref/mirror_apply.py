"""The transitions of `FastMonitor` (fast_monitor.py) on the mirror of the state (mirror.py).

Each method is `apply`'s transition of one event kind (apply.py), in place: it tests the same
conditions and returns True once it changed the mirror as `apply` changes the state, or
returns False, having changed nothing, where any condition fails (the monitor then has the
specification itself give the verdict).
"""

from __future__ import annotations

from pdref.mirror import MirrorLife, band_covers
from pdref.pool import PoolError
from pdref.progress import ProgressError
from pdref.state import Phase, Quarantine, Span, Unfenced

_new = tuple.__new__


class MirrorTransitions:
    """Mixed into FastMonitor: `self.mirror` (MirrorState), and its dicts `self._requests`,
    `self._pending`, `self._used`, `self._token_layer_bytes` and `self._layout` (the
    geometry's layer kinds, None without) looked up once."""


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
                                                    e.pages, m.geometry.layers, m.lives,
                                                    e.state_slot)
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
        if self._layout is None:
            if e.bytes != (self._token_layer_bytes * (l1 - l0 if l1 > l0 else 0)
                           * (b - a if b > a else 0)):
                return False
        elif not self._kv_bytes_ok(life, e):  # (v3) per kind: mirror_hybrid.py
            return False
        if l0 < l1 and a < b:  # an empty region reads nothing
            if life.held is None and life.computed is None:  # the computed band
                if not band_covers(life.c_lo, life.c_hi, a, b):
                    return False
            elif life.held_value().first_gap(layers, tokens) is not None:
                return False
        elif e.state:  # (v3) a state span (its tokens are empty) is mirror_hybrid.py's
            return False
        for other in life.in_flight:
            (o0, o1), (x, y) = other.layers, other.tokens
            if l0 < o1 and o0 < l1 and l0 < l1 and o0 < o1 and a < y and x < b and a < b and x < y:
                return False
        count = self._pending.get(life.producer, 0)
        if count >= m.max_pending:
            return False
        life.in_flight.append(_new(Span, (e.span, layers, tokens, e.bytes, None)))
        self._pending[life.producer] = count + 1
        self._used[e.span] = e.req
        return True

    @staticmethod
    def _span_index(life: MirrorLife, span_id) -> int | None:
        """Where span `span_id` is among the life's spans in flight; None when not there."""
        in_flight = life.in_flight
        if in_flight and in_flight[0].span == span_id:  # the usual order: oldest first
            return 0
        return next((i for i, s in enumerate(in_flight) if s.span == span_id), None)

    def _land(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None:
            return False
        in_flight = life.in_flight
        # the usual order, oldest first, tested here: this runs for every span
        index = 0 if in_flight and in_flight[0].span == e.span else self._span_index(life, e.span)
        if index is None:
            return False
        span = life.in_flight[index]
        (l0, l1), (a, b) = span.layers, span.tokens
        if l0 < l1 and a < b and not self._publish(life, span):
            return False
        del life.in_flight[index]
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

    @staticmethod
    def _lands(life: MirrorLife, span: Span) -> bool:
        """Whether `_publish` of `span` would succeed; changes nothing (`landing` asks it
        before a shell writes the span's bytes, so a refused land writes none)."""
        (l0, l1), (a, b) = span.layers, span.tokens
        if not (l0 < l1 and a < b):  # an empty span publishes nothing
            return True
        if life.progress is None and not life.finished and l0 <= 0 and l1 >= life.layers:
            lo, hi = life.p_lo, life.p_hi
            if lo < hi and a < hi and lo < b:  # overlaps what landed
                return False
            if life.prefix <= a and b <= life.prompt and (lo == hi or a == hi or b == lo):
                return True  # the band's own cases of `_publish`
        try:
            life.progress_value().add(span.layers, span.tokens)
        except ProgressError:
            return False
        return True

    def _fail(self, e) -> bool:
        life = self._requests.get(e.req)
        index = None if life is None else self._span_index(life, e.span)
        if index is None:
            return False
        span = life.in_flight.pop(index)
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
            if not band_covers(life.c_lo, life.c_hi, life.prefix, life.prompt):
                return False
        elif life.computed.first_gap((0, life.layers), (life.prefix, life.prompt)) is not None:
            return False
        life.phase = Phase.PRODUCED
        return True

    def _admit(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None or not life.can_admit():
            return False
        self._finish(life)
        return True

    @staticmethod
    def _finish(life: MirrorLife) -> None:
        """Admitted: nothing more may land (the caller checked that it may be admitted)."""
        life.phase = Phase.ADMITTED
        if life.progress is None:
            life.finished = True
        else:
            life.progress = life.progress.finished_now()

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
