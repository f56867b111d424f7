"""The producer process: runs a request's compute steps and feeds its copier.

After each step it emits `computed`, then issues the spans that step made ready, one by one;
after the last step the first token's LM head (`head_s`) runs before `produced` (in whole
mode the copy starts after it; in chunk and layer modes, as in pdgpu's step loop, the last
spans are issued first and their copies overlap it);
when `Monitor.can_issue` says the producer already has max_pending spans in flight, the
producer blocks (no further compute) until a span lands. The copier (pdsim/core/copier.py, serial
or pipelined) serves spans in issue order: fixed cost, gather (which slows overlapping
compute), then the link's stages.
"""

from __future__ import annotations

from collections import deque

import attrs

from pdref import events as ev
from pdref.events import Mode
from pdref.plan import Region
from pdsim.core.config import RequestSpec
from pdsim.core.copier import Copier, SpanTimes
from pdsim.core.steps import Step, copied_bytes, plan_steps


@attrs.define
class Job:
    """A request while the producer works on it (mutable process state)."""

    request: RequestSpec
    steps: list[Step]
    index: int = 0
    ready: deque = attrs.Factory(deque)  # spans computed but not yet issued
    spans_total: int = 0
    spans_issued: int = 0
    spans_landed: int = 0
    produced: bool = False
    ended: bool = False  # the life was released or aborted (faults: nothing more happens)

    @property
    def req(self) -> str:
        return self.request.req


class Producer:
    """One producer device: a compute stream and its copier."""

    def __init__(self, env, sim, name: str) -> None:
        self.env, self.sim, self.name = env, sim, name
        self.job: Job | None = None  # the request being computed, None when idle
        self.blocked: Job | None = None
        self.copier = Copier(sim.cfg.costs)
        self.gathers: deque[tuple[float, float]] = deque()
        self.lands: deque[float] = deque()  # land times of spans in flight, in FIFO order

    @property
    def idle(self) -> bool:
        return self.job is None

    def start(self, request: RequestSpec) -> None:
        cfg = self.sim.cfg
        steps = plan_steps(cfg, request)
        self.job = self._new_job(request, steps)
        self.sim.monitor.reserve(self.env.now, request.req, request.prompt, request.prefix,
                                 self.name)
        self._next_step(self.job)

    def _new_job(self, request: RequestSpec, steps: list[Step]) -> Job:
        return Job(request, steps, spans_total=sum(len(s.spans) for s in steps))

    def _next_step(self, job: Job) -> None:
        if job.index == len(job.steps):
            self._finish(job)
            return
        step = job.steps[job.index]
        duration = self._stretched(step.base_s)
        if self.sim.cfg.stages and (duration or not self.sim.cfg.no_compute):
            name = "fill" if self.sim.cfg.no_compute else "compute"  # export: the payload
            self.sim.stage(self.env.now, job.req, name, duration, None, f"{self.name}.compute")
        self.env.after(duration, self._end_step, job, step)

    def _stretched(self, base: float) -> float:
        """Compute time when known gathers overlap [now, now + base]: contention slows it."""
        now, end = self.env.now, self.env.now + base
        while self.gathers and self.gathers[0][1] <= now:
            self.gathers.popleft()
        overlap = sum(max(0.0, min(g1, end) - max(g0, now)) for g0, g1 in self.gathers)
        return base + self.sim.cfg.costs.contention * overlap

    def _end_step(self, job: Job, step: Step) -> None:
        now = self.env.now
        self.sim.emit(ev.Computed(now, job.req, step.layers, step.tokens))
        job.index += 1
        last = job.index == len(job.steps)
        if last and not self._head_s() and self.sim.cfg.mode is Mode.WHOLE:
            self._produce(job)  # chunk/layer: once the last spans are issued (_finish)
        job.ready.extend(step.spans)
        if last and self._head_s() and self.sim.cfg.mode is Mode.WHOLE:
            self._run_head(job, self._issue_ready)  # the whole copy starts after `produced`
            return
        self._issue_ready(job)

    def _head_s(self) -> float:
        return 0.0 if self.sim.cfg.no_compute else self.sim.cfg.costs.head_s

    def _run_head(self, job: Job, then) -> None:
        """The first token's LM head (after the last step, before `produced`), then `then`."""
        head = self._head_s()
        if self.sim.cfg.stages:
            self.sim.stage(self.env.now, job.req, "head", head, None, f"{self.name}.compute")
        self.env.after(head, self._head_done, job, then)

    def _head_done(self, job: Job, then) -> None:
        self._produce(job)
        then(job)

    def _produce(self, job: Job) -> None:
        job.produced = True
        self.sim.emit(ev.Produced(self.env.now, job.req, 0))
        self.sim.try_admit(job)

    def _issue_ready(self, job: Job) -> None:
        while job.ready:
            if not self.sim.monitor.can_issue(self.name):
                self._block(job)
                return
            self._issue(job, job.ready.popleft())
        self._next_step(job)

    def _block(self, job: Job) -> None:
        """Wait for a free pending slot: the oldest span in flight lands first (FIFO lanes)."""
        self.blocked = job
        if self.sim.cfg.stages:
            wait = self.lands[0] - self.env.now
            self.sim.stage(self.env.now, job.req, "blocked", wait, None, f"{self.name}.compute")

    def _finish(self, job: Job) -> None:
        if not job.produced and self._head_s():
            self._run_head(job, self._finish)  # chunk/layer: the last copies overlap the head
            return
        if not job.produced:
            self._produce(job)
        self.job = None
        self.env.at(self.env.now, self.sim.dispatch)

    def _issue(self, job: Job, region: Region) -> None:
        cfg, now = self.sim.cfg, self.env.now
        span = self.sim.next_span()
        nbytes = region.bytes(cfg.geometry)
        job.spans_issued += 1
        self.sim.emit(ev.Issue(now, job.req, span, region.layers, region.tokens, nbytes))
        moved = copied_bytes(cfg, nbytes, job.spans_issued == job.spans_total)
        self._schedule_copy(job, span, self.copier.schedule(now, moved))

    def _schedule_copy(self, job: Job, span: int, times: SpanTimes) -> None:
        """The copier runs the span's stages at `times`, then the span lands."""
        self.gathers.append(times.stages[0][1:])
        if self.sim.cfg.stages:
            self._schedule_stages(job.req, span, times.stages)
        self.lands.append(times.land)
        self.env.at(times.land, self._land, job, span)

    def _schedule_stages(self, req: str, span: int, stages, emit=None) -> None:
        """Stage events (absolute (name, start, end)) at their start times; stages starting
        together share one heap event (handed to `emit`, by default straight to the trace)."""
        emit = emit or self.sim.emit_all
        groups: dict[float, list] = {}
        for name, a, b in stages:
            groups.setdefault(a, []).append(
                ev.Stage(a, req, name, b, span, f"{self.name}.{name}"))
        for t, stages in groups.items():
            self.env.at(t, emit, stages)

    def _land(self, job: Job, span: int) -> None:
        self.sim.emit(ev.Land(self.env.now, job.req, span))
        self.lands.popleft()
        job.spans_landed += 1
        self.sim.try_admit(job)
        self._unblock()

    def _unblock(self) -> None:
        """A pending slot came free: the blocked job issues its next spans."""
        if self.blocked is not None and self.sim.monitor.can_issue(self.name):
            blocked, self.blocked = self.blocked, None
            self._issue_ready(blocked)
