"""A producer's copier in the simulator: when each span's stages run, given when it is issued.

Every span runs gather (on the producer: it slows overlapping compute, `contention`), then
the link's stages (d2h and h2d, the link's two directions, for a host-staged copy). The
profile's `copier` says how spans share them:
- serial (the seed engine's copier): one worker. A span starts when it is issued and the
  previous span landed, pays `span_s`, gathers, waits `link_latency_s`, then runs the link's
  stages; the next span starts when it landed. So n spans cost n fixed costs one after
  another: chunked export is slower than whole.
- pipelined (pdgpu's copier since issue 11): each stage on its own lane, spans in issue order
  on every lane. A span's gather starts `span_s` after its issue once the gather lane is free;
  its first link stage `link_latency_s` after its gather ends once that lane is free; each
  further stage when the span's previous stage ended and its lane is free. So span k+1's d2h
  overlaps span k's h2d, up to `max_pending` spans in flight (the producer issues no more).
A streamed link (link profile `pipelined = true`) starts a span's link stages together (the
bytes flow through them); a stage then ends no earlier than the one before it.
With one span in flight both copiers give the same times.
"""

from __future__ import annotations

from typing import NamedTuple

from pdsim.core.costs import Costs

WORKER = "worker"  # the serial copier's one lane
_new = tuple.__new__


def contended_spans(costs: Costs, stages) -> tuple[tuple[float, float], ...]:
    """(start, end) of the stages, (name, start, end) each, that slow overlapping compute
    (`Costs.contended`), in stage order."""
    contended = costs.contended
    return tuple((a, b) for name, a, b in stages if name in contended)


class SpanTimes(NamedTuple):
    """When one span's copy runs (absolute times: `base` plus the offsets). A NamedTuple: one
    is made per span; a serial copier's spans of one size share their offsets."""

    start: float  # the copier began working on it (its fixed cost starts)
    base: float  # the stages' offsets count from it
    offsets: tuple[tuple[str, float, float], ...]  # (stage name, start, end) - base, gather first
    land: float  # every stage is done: the span lands
    contended: tuple[tuple[float, float], ...]  # (start, end) - base of the stages that slow
    # overlapping compute (`Costs.contended`), in stage order

    @property
    def stages(self) -> tuple[tuple[str, float, float], ...]:
        """(stage name, start, end) of each stage, gather first."""
        base = self.base
        return tuple((name, base + a, base + b) for name, a, b in self.offsets)

    def stage(self, name: str) -> tuple[float, float] | None:
        return next(((a, b) for n, a, b in self.stages if n == name), None)


class Copier:
    """The lanes of one producer's copier and when each is free next (mutable)."""

    def __init__(self, costs: Costs) -> None:
        self.costs = costs
        self.free: dict[str, float] = {}  # lane -> when its last span's stage ends
        # serial: nbytes -> (stage offsets, copy time, contended offsets) of a span alone;
        # pipelined: nbytes -> its SpanTimes alone, issued at 0. Spans of a workload share a
        # few sizes (every full chunk's): worked out once a size.
        self._plans: dict[int, tuple] = {}
        # schedule(issue_t, nbytes) -> SpanTimes: place a span of `nbytes` issued at
        # `issue_t` on the lanes (bound once: it runs for every span)
        self.schedule = self._serial if self.serial else self._pipelined

    @property
    def serial(self) -> bool:
        return self.costs.copier == "serial"

    def _serial(self, issue_t: float, nbytes: int) -> SpanTimes:
        free = self.free.get(WORKER, 0.0)
        start = issue_t if issue_t >= free else free
        plan = self._plans.get(nbytes)
        if plan is None:
            plan = self._plans[nbytes] = self._plan(nbytes)
        offsets, copy_s, contended = plan
        land = start + copy_s
        self.free[WORKER] = land
        return _new(SpanTimes, (start, start, offsets, land, contended))  # (no Python __new__)

    def _plan(self, nbytes: int) -> tuple:
        """A serial span's stage offsets from its start, copy time and contended offsets."""
        offsets = tuple(self.costs.stage_plan(nbytes))
        return offsets, self.costs.copy_s(nbytes), contended_spans(self.costs, offsets)

    def _pipelined(self, issue_t: float, nbytes: int) -> SpanTimes:
        """A span on its lanes: as it would run alone (its size's plan, worked out once)
        when every lane is free by the time the plan reaches it, else queued behind them."""
        free = self.free
        plan = self._plans.get(nbytes)
        if plan is None:
            plan = self._plans[nbytes] = self._queued(0.0, nbytes, {})
        for name, a, _ in plan.offsets:
            if free.get(name, 0.0) > issue_t + a:
                return self._queued(issue_t, nbytes, free)
        for name, _, b in plan.offsets:
            free[name] = issue_t + b
        return _new(SpanTimes, (issue_t, issue_t, plan.offsets, issue_t + plan.land,
                                plan.contended))

    def _queued(self, issue_t: float, nbytes: int, free: dict[str, float]) -> SpanTimes:
        """A span placed on the lanes in `free` (updated): each stage when its lane is free."""
        c = self.costs
        g0 = max(issue_t + c.span_s, free.get("gather", 0.0))
        stages = [("gather", g0, g0 + c.gather_s(nbytes))]
        ready = stages[0][2] + c.link_latency_s  # when the first link stage may start
        for name, per_byte in c.link_stages:
            start = max(ready, free.get(name, 0.0))
            end = start + per_byte * nbytes
            if c.streamed and len(stages) > 1:
                end = max(end, stages[-1][2])  # bytes flow through: not before the one before
            stages.append((name, start, end))
            ready = start if c.streamed else end
        for name, _, end in stages:
            free[name] = end
        stages = tuple(stages)  # (absolute: base 0)
        return SpanTimes(g0 - c.span_s, 0.0, stages, max(end for _, _, end in stages),
                         contended_spans(c, stages))

    def _free(self, lane: str) -> float:
        return self.free.get(lane, 0.0)

    def stopped(self, times: SpanTimes, stop_t: float) -> None:
        """A fault: the span's writer stopped at `stop_t` (before its land: a deadline cut it;
        after: it hung), so the lanes it held are free then and not at its planned ends."""
        if self.serial:
            self.free[WORKER] = stop_t
            return
        for name, start, end in times.stages:
            if stop_t >= times.land:
                self.free[name] = max(self._free(name), stop_t)
            elif self.free.get(name) == end:  # nothing queued behind it on this lane yet
                self.free[name] = max(start, min(end, stop_t))

    def restart(self, t: float) -> None:
        """A fresh process at `t`: every lane free."""
        self.free = dict.fromkeys(self.free, t)
