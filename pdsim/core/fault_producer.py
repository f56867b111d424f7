"""A producer that faults can hit (pdsim/core/faults.py): spans that fail, stall or time out, jobs
that are cancelled, a process that dies.

Each span's fate is drawn at its issue (`Draws.span_fate`): when its writer stops and whether
it fails first. The worker's timeline is therefore known at issue and nothing later moves it:
a cancelled span's writer runs its copy out and is fenced when it stops. A job whose span
failed computes no further step; its life is aborted (by the FaultSim) once every span of it
landed or was fenced, as the engine does. A dead producer does nothing from its death on; at
its detection `declare_dead` fails and fences what its worker held.
"""

from __future__ import annotations

import enum

import attrs

from pdref import events as ev
from pdsim.core.copier import contended_spans
from pdsim.core.faults import Draws, SpanFate
from pdsim.core.producer import Job, Producer


class SpanState(enum.Enum):
    IN_FLIGHT = "in flight"
    UNFENCED = "unfenced"  # failed or cancelled; its writer has not stopped yet
    DONE = "done"  # landed or fenced


@attrs.define(eq=False)
class SpanRun:
    """One issued span of a FaultJob on its producer's worker."""

    span: int
    job: FaultJob
    fate: SpanFate
    state: SpanState = SpanState.IN_FLIGHT


@attrs.define(eq=False)
class FaultJob(Job):
    """A Job that can fail: its spans still in flight or unfenced, and its first error."""

    runs: dict = attrs.Factory(dict)  # span id -> SpanRun, in flight or unfenced
    error: str | None = None  # the first failure of this life; the life cannot be admitted

    @property
    def failed(self) -> bool:
        return self.error is not None


class FaultyProducer(Producer):
    """A Producer whose spans meet the drawn fates and which a kill can stop."""

    def __init__(self, env, sim, name: str, draws: Draws) -> None:
        super().__init__(env, sim, name)
        self.draws = draws
        self.runs: dict[int, SpanRun] = {}  # this worker's spans in flight or unfenced
        self.dead_at: float | None = None  # died then; nothing it scheduled happens any more
        self.declared_dead = False  # the decoder knows: no request is sent to it

    @property
    def available(self) -> bool:
        return not self.declared_dead

    @property
    def down(self) -> bool:
        return self.dead_at is not None

    def _new_job(self, request, steps) -> FaultJob:
        return FaultJob(request, steps, spans_total=sum(len(s.spans) for s in steps))

    def assign(self, request, hit=None):
        """Reserve and queue; on a dead, undetected producer the request waits for the
        detection (the decoder does not know yet). (No prefix cache with faults: `hit`
        is None.)"""
        job = super().assign(request, hit)
        self.sim.on_start(job, self)
        return job

    def _start_next(self) -> None:
        if not self.down:
            super()._start_next()

    # -- compute: stops at the end of the step when its job failed or ended ------------------

    def _stopped(self, job: FaultJob) -> bool:
        """Whether this compute callback is void: the producer died, or the job's life
        failed or ended (then the compute stream lets the job go)."""
        if self.down:
            return True
        if job.ended or job.failed:
            self._let_go(job)
            return True
        return False

    def _end_step(self, job, step) -> None:
        if not self._stopped(job):
            super()._end_step(job, step)

    def _head_done(self, job, then) -> None:
        if not self._stopped(job):
            super()._head_done(job, then)

    def _let_go(self, job: FaultJob) -> None:
        """The compute stream leaves `job`: the producer takes the next request."""
        self._unload(job)
        if self.job is job:
            self.job = self.blocked = None
            self.env.at(self.env.now, self._start_next)

    def abandon(self, job: FaultJob) -> None:
        """`job` failed or ended: a job blocked on a pending slot is let go at once (one
        computing is let go at the end of its step)."""
        if self.blocked is job:
            self._let_go(job)
        elif job in self.queue:  # cancelled before its compute began
            self.queue.remove(job)
            self._unload(job)

    # -- copies ------------------------------------------------------------------------------

    def _schedule_copy(self, job: FaultJob, span: int, times) -> None:
        cfg = self.sim.cfg
        fate = self.draws.span_fate(self.env.now, times.start, times.land)
        run = SpanRun(span, job, fate)
        self.runs[span] = job.runs[span] = run
        self.copier.stopped(times, fate.stop_t)
        if fate.stalled and cfg.stages:
            self.sim.stage(self.env.now, job.req, "stalled", fate.stop_t - self.env.now,
                           span, f"{self.name}.copy")
        stages = self._stages_run(fate, times)
        if stages:  # the stages it ran slow overlapping compute (cut at its stop)
            self.gathers.extend(contended_spans(cfg.costs, stages))
            if cfg.stages:
                self._schedule_stages(job.req, span, stages)
        self.lands.append(fate.stop_t)
        if fate.fail_t is not None:
            self.env.at(fate.fail_t, self._fail, run)
        self.env.at(fate.stop_t, self._stop, run)

    def _schedule_stages(self, req: str, span: int, stages) -> None:
        """Each stage is recorded at its start if its writer still runs then (a death stops
        it); stages starting together share one heap event."""
        groups: dict[float, list] = {}
        for name, a, b in stages:
            groups.setdefault(a, []).append((a, req, name, b, span, self.lane_prefix + name))
        for t, rows in groups.items():
            self.env.at(t, self._record_stages, span, rows)

    def _record_stages(self, span: int, rows) -> None:
        """Stages of a writer still running on this worker (not after a death)."""
        if not self.down and span in self.runs:
            self.sim.stage_rows.extend(rows)

    def _stages_run(self, fate: SpanFate, times) -> list:
        """The stages the writer ran: none when it hung, those before its stop when a
        deadline stopped it early, else all."""
        if fate.stalled:
            return []
        if fate.stop_t >= times.land:
            return list(times.stages)
        return [(name, a, min(b, fate.stop_t)) for name, a, b in times.stages
                if a < fate.stop_t]

    def _fail(self, run: SpanRun) -> None:
        """The span's failure is detected: `fail` (unless it was cancelled or lost before),
        when the decoder handles it (between decode steps, as pdgpu serve's loop)."""
        if self.down or run.state is not SpanState.IN_FLIGHT:
            return
        if self.sim.decoder.stepping:
            self.sim.decoder.deliver(self._fail, run)
            return
        self.fail_span(run, run.fate.error)

    def fail_span(self, run: SpanRun, error: str) -> None:
        job = run.job
        self.sim.emit(ev.Fail(self.env.now, job.req, run.span, error))
        run.state = SpanState.UNFENCED
        if job.error is None:
            job.error = error
        self.abandon(job)

    def cancel_spans(self, job: FaultJob) -> None:
        """After `job`'s abort: its spans in flight are cancelled (fenced when they stop)."""
        for run in job.runs.values():
            run.state = SpanState.UNFENCED

    def _stop(self, run: SpanRun) -> None:
        """The span's writer stops: it lands, or it is fenced if it failed or was cancelled."""
        if self.down or run.state is SpanState.DONE:
            return
        if run.state is SpanState.IN_FLIGHT and self.sim.decoder.stepping:
            self.sim.decoder.deliver(self._stop, run)  # it lands once the decoder handles it
            return
        del self.runs[run.span], run.job.runs[run.span]
        fenced = run.state is SpanState.UNFENCED
        run.state = SpanState.DONE
        if fenced:
            self.lands.popleft()
            self.sim.emit(ev.Fence(self.env.now, run.job.req, run.span))
            self._unblock()
        else:
            self._land(run.job, run.span)
        self.sim.span_ended(run.job, fenced)

    # -- death -------------------------------------------------------------------------------

    def die(self) -> None:
        self.dead_at = self.env.now

    def declare_dead(self) -> list[FaultJob]:
        """Detected dead: every span its worker held fails (if in flight) and is fenced (the
        transport is torn down); returns its jobs whose lives are still live."""
        error = f"producer {self.name} lost"
        jobs = {} if self.job is None else {id(self.job): self.job}
        for run in self.runs.values():
            if run.state is SpanState.IN_FLIGHT:
                self.fail_span(run, error)
            self.sim.emit(ev.Fence(self.env.now, run.job.req, run.span))
            run.state = SpanState.DONE
            del run.job.runs[run.span]
            jobs[id(run.job)] = run.job
        self.runs.clear()
        self.lands.clear()
        self.gathers.clear()
        for job in [*self.queue, *(job for job, _ in self.outbox)]:
            jobs[id(job)] = job  # reserved, not started / computed, spans not yet issued
        self.queue.clear()
        self.outbox.clear()
        self.load, self.source_free = 0, self.cfg.source_pages
        self.job = self.blocked = None
        self.declared_dead = True
        return [job for job in jobs.values() if not job.ended]

    def rejoin(self) -> None:
        """A restarted producer: a fresh process with an idle worker."""
        self.dead_at, self.declared_dead = None, False
        self.copier.restart(self.env.now)
