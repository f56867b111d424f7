"""(v3) The fast monitor's transitions for a geometry with layer kinds (mirror_apply.py has the
rest): each tests what `apply` tests for that kind (apply.py, hybrid.py) on the mirror and
returns False, having changed nothing, where `apply` would refuse; else it changes the mirror
as `apply` changes the state. FastMonitor selects these handlers only for such a geometry,
so a dense run never passes through here."""

from __future__ import annotations

from pdref import hybrid
from pdref.state import Phase, hybrid_missing
from pdref.violations import Violation


class HybridTransitions:
    """Mixed into FastMonitor beside MirrorTransitions (same attributes)."""

    def _kv_bytes_ok(self, life, e) -> bool:
        try:
            want = hybrid.kv_span_bytes(self.mirror.geometry, life, e)
        except Violation:  # SLIDE-1
            return False
        return e.bytes == want

    def _reserve_h(self, e) -> bool:
        m = self.mirror
        if m.geometry.recurrent and (e.state_slot is None or hybrid.slot_holder(
                self._layout, self._requests.values(), m.unfenced, e.producer,
                e.state_slot) is not None):
            return False
        return self._reserve(e)

    def _computed_h(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None:
            return False
        if self.mirror.geometry.recurrent:
            try:
                hybrid.check_state_write(self._layout, life, e)
            except Violation:  # STATE-4
                return False
        return self._computed(e)

    def _issue_h(self, e) -> bool:
        """A KV span as `_issue` (its bytes per kind); a state span here."""
        if not e.state:
            return self._issue(e)
        life = self._requests.get(e.req)
        if life is None or e.span in self._used:
            return False
        count = self._pending.get(life.producer, 0)
        try:
            hybrid.check_state_span(self.mirror.geometry, life, life.computed_value(), count,
                                    self.mirror.max_pending, e)
        except Violation:
            return False
        life.in_flight.append(hybrid.state_span(life, e))
        self._pending[life.producer] = count + 1
        self._used[e.span] = e.req
        return True

    def _land_h(self, e) -> bool:
        life = self._requests.get(e.req)
        index = None if life is None else self._span_index(life, e.span)
        if index is None:
            return False
        span = life.in_flight[index]
        if not self._land(e):
            return False
        if span.slot is not None:  # a state span: its layers' state landed
            life.states = life.states.union(span.layers)
        return True

    def _hybrid_ready(self, life) -> bool:
        """`SystemState.can_admit` of a geometry with layer kinds."""
        return (life.phase is Phase.PRODUCED and not life.in_flight and not life.failed
                and hybrid_missing(self.mirror.geometry, life.progress_value().landed,
                                   life) is None)

    def _admit_h(self, e) -> bool:
        life = self._requests.get(e.req)
        if life is None or not self._hybrid_ready(life):
            return False
        self._finish(life)
        return True
