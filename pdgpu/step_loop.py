"""The engine's step loop over one life of a request (a part of Engine: it reads the
engine's `config`, `copier`, `ledger` and `faults`), one loop over the step schedule of
`pdref.plan.plan_steps`:
  run the step     launch its compute (on CUDA nothing waits for it) and mark its readiness
  emit `computed`  for every step whose readiness mark completed, in order
  issue            the spans those steps made ready, as pdref's `can_issue` allows (the
                   producer blocks while max_pending spans are in flight or unfenced)
  poll             completions: the copier's watcher emits `land`/`fail` as they happen
"""

from __future__ import annotations

from collections import deque

import attrs

from pdgpu.engine_ledger import LifeKV
from pdgpu.handoff import kv_range
from pdgpu.payload import fill_payload
from pdgpu.prefill import Prefill
from pdgpu.recorder import Recorder
from pdref.events import Mode
from pdref.plan import Step, plan_steps


class EngineError(RuntimeError):
    """A run that cannot go on (every retry failed, admission refused, payload corrupted)."""


@attrs.define
class Pending:
    """A step launched whose `computed` is not emitted yet."""

    step: Step
    start: object  # readiness marks (copier.Mark) before and after its compute
    end: object


@attrs.define
class Loop:
    """The per-life state of the step loop."""

    life: LifeKV
    prefill: Prefill  # the request's compute, step by step (its `last` hidden state)
    pending: deque = attrs.Factory(deque)  # Pending, in step order
    ready: deque = attrs.Factory(deque)  # (Region, mark) computed and not yet issued


class StepLoop:
    """The step loop's methods of Engine (engine.py)."""

    def _run_steps(self, rec: Recorder, loop: Loop) -> None:
        """The one loop: launch each step, emit `computed` for the steps whose readiness mark
        completed, issue what they made ready (whole mode: after `produced`), and surface
        what the watcher hit while landing; then the same for the steps still running."""
        r, c = loop.life.request, self.config
        steps = plan_steps(c.mode, self.geometry, r.prompt, r.prefix, c.chunk,
                           compute=not c.no_compute)
        for step in steps:
            if self.ledger.failed(r.req):
                return
            if self.faults.issues_before_compute:
                loop.ready.extend((s, self.copier.mark_ready()) for s in step.spans)
                self._issue_ready(rec, loop)
            start = self.copier.mark_ready()
            self._compute(loop, step)
            loop.pending.append(Pending(step, start, self.copier.mark_ready()))
            self._emit_computed(rec, loop)
            if c.mode is not Mode.WHOLE:
                self._issue_ready(rec, loop)
            self._raise_copy_errors()
        while loop.pending and not self.ledger.failed(r.req):  # the device may still compute
            loop.pending[0].end.wait()
            self._emit_computed(rec, loop)
            if c.mode is not Mode.WHOLE:
                self._issue_ready(rec, loop)

    def _compute(self, loop: Loop, step: Step) -> None:
        """Launch one step's compute (on CUDA this only enqueues kernels)."""
        if self.config.no_compute:
            fill_payload(loop.life.src, kv_range(self.geometry, step.layers), step.tokens)
        elif self.config.mode is Mode.LAYER:
            loop.prefill.layer(step.layers[0])
        else:
            loop.prefill.chunk(step.tokens)

    def _emit_computed(self, rec: Recorder, loop: Loop) -> None:
        """`computed` (and its `compute` stage) for each launched step whose readiness mark
        completed, in order (never waiting); its spans become ready to issue."""
        while loop.pending and loop.pending[0].end.done():
            done = loop.pending.popleft()
            step = done.step
            name = "fill" if self.config.no_compute else "compute"
            rec.stage(loop.life.req, name, done.start.time(), done.end.time(),
                      resource="producer", tokens=step.tokens)
            self.ledger.computed(loop.life.req, step.layers, step.tokens)
            loop.ready.extend((s, done.end) for s in step.spans)

    def _issue_ready(self, rec: Recorder, loop: Loop) -> None:
        """Issue the ready spans in order, each once pdref's `can_issue` allows it."""
        req = loop.life.req
        while loop.ready:
            self._wait_for_slot(rec, req)
            if self.ledger.failed(req):
                return
            region, ready = loop.ready.popleft()
            self.ledger.issue(loop.life, region, ready)

    def _wait_for_slot(self, rec: Recorder, req: str) -> None:
        """Block (no compute) while the producer has max_pending spans in flight."""
        if self.faults.skips_block:
            return
        start, waited = rec.now(), False
        while True:
            seen = self.copier.completions
            if self.ledger.failed(req) or self._may_issue(rec):
                break
            if not self.copier.in_flight:  # nothing will land: waiting would never end
                raise EngineError(f"request {req!r}: pdref refuses an issue with no copy in "
                                  "flight (max_pending held by spans that never end)")
            self.copier.wait_progress(seen)
            self._raise_copy_errors()
            waited = True
        if waited:
            rec.stage(req, "blocked", start, rec.now(), resource="producer")

    def _may_issue(self, rec: Recorder) -> bool:
        """pdref's `can_issue`, asked once the copier has a free staging slot (with none, no
        issue can go out whatever pdref says: one query per issue, not one per wake-up)."""
        return self.copier.free_slots > 0 and rec.ask("can_issue")

    def _wait_all(self) -> None:
        self.copier.drain()
        self._raise_copy_errors()

    def _raise_copy_errors(self) -> None:
        """A violation raised on the copier's watcher (e.g. by a `land`) stops the run here."""
        if self.copier.callback_error is not None:
            raise self.copier.callback_error
