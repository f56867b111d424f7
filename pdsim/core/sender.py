"""The producer's sender (a part of Producer: it reads the producer's queue, monitor and
copier): hands the spans a step made ready to the copier as pdref's `can_issue` allows, and
lands them. Two senders (`SimConfig.sender`):
- blocking (pdgpu run's step loop): when `Monitor.can_issue` says the producer already has
  max_pending spans in flight, its compute waits until a span lands;
- queued (pdgpu serve's sender thread): compute goes on; ready spans wait in the producer's
  outbox, in order across its requests, and are issued as pending slots come free.
The copier (copier.py, serial or pipelined) serves spans in issue order: fixed cost, gather
(which slows overlapping compute), then the link's stages.
"""

from __future__ import annotations

from pdref import events as ev
from pdref.plan import Region
from pdref.rows import IssueRow, LandRow, new_row
from pdsim.core.copier import SpanTimes
from pdsim.core.job import Job


class Sender:
    """The sender's methods of Producer (producer.py)."""

    def _issue_ready(self, job: Job) -> None:
        if self.queued:
            self.outbox.extend((job, region) for region in job.ready)
            job.ready.clear()
            self._pump()
            self._next_step(job)
            return
        while job.ready:
            if not self.monitor.can_issue(self.name):
                self._block(job)
                return
            self._issue(job, job.ready.popleft())
        self._next_step(job)

    def _pump(self) -> None:
        """Queued sender: issue the outbox's spans in order while pending slots are free."""
        while self.outbox and self.monitor.can_issue(self.name):
            job, region = self.outbox.popleft()
            if not (job.ended or job.failed):  # a stopped life sends no more spans
                self._issue(job, region)

    def _block(self, job: Job) -> None:
        """Wait for a free pending slot: the oldest span in flight lands first (FIFO lanes)."""
        self.blocked = job
        if self.stages:
            wait = max(0.0, self.lands[0] - self.env.now)  # a land the decoder defers
            self.sim.stage(self.env.now, job.req, "blocked", wait, None, self.compute_lane)

    def _issue(self, job: Job, region: Region) -> None:
        now, sim = self.env.now, self.sim
        span = sim.next_span()
        if self.hybrid:
            nbytes = self._emit_hybrid(now, job, span, region)
        else:
            (l0, l1), (a, b) = layers, tokens = region.layers, region.tokens  # Region.bytes
            nbytes = (self.bytes_per_token_layer * (l1 - l0 if l1 > l0 else 0)
                      * (b - a if b > a else 0))
            self.emit(new_row(IssueRow, (now, job.req, span, layers, tokens, nbytes)))
        job.spans_issued += 1
        if self.land_byte_s or self.land_slow:
            self.span_bytes[span] = nbytes
        if job.spans_issued == job.spans_total:  # the last: the recurrent state goes too
            nbytes += self.state_bytes  # (steps.copied_bytes inlined)
        self._schedule_copy(job, span, self.copier.schedule(now, nbytes))

    def _emit_hybrid(self, now: float, job: Job, span: int, region: Region) -> int:
        """(v3) Issue a span of a geometry with layer kinds: its bytes per kind, a state
        span as an event of its own (a row stands for a KV span); its bytes."""
        request = job.request
        nbytes = region.span_bytes(self.cfg.geometry, request.prompt, request.prefix)
        if region.state:
            self.emit(ev.Issue(now, job.req, span, region.layers, region.tokens, nbytes, True))
        else:
            self.emit(new_row(IssueRow, (now, job.req, span, region.layers, region.tokens,
                                         nbytes)))
        return nbytes

    def _schedule_copy(self, job: Job, span: int, times: SpanTimes) -> None:
        """The copier runs the span's stages at `times`, then the span lands."""
        base, gathers = times.base, self.gathers
        for a, b in times.contended:  # they slow overlapping compute (`Costs.contended`)
            gathers.append((base + a, base + b))
        if self.stages:  # recorded now (planned); rows made when the trace is read
            self.sim.span_stages.append((job.req, span, self.lane_prefix, base, times.offsets))
        self.lands.append(times.land)
        # the span's bytes reach the decoder then: it lands when the decoder handles it
        self.env.at(times.land, self.sim.decoder.deliver, self._land, job, span)

    def _land(self, job: Job, span: int) -> None:
        self.emit(new_row(LandRow, (self.env.now, job.req, span)))
        if self.span_bytes:  # the decoder writes the span's bytes into its slab
            nbytes = self.span_bytes.pop(span, 0)
            if self.land_byte_s:
                self.sim.decoder.charge(self.land_byte_s * nbytes)
            if self.land_slow:
                self.cores.slow_prefill(self.land_slow * nbytes)
        self.lands.popleft()
        job.spans_landed += 1
        if job.produced and job.spans_landed >= job.spans_total:  # else no admission yet
            self.sim.try_admit(job)
        if self.outbox or self.blocked is not None:
            self._unblock()

    def _unblock(self) -> None:
        """A pending slot came free: the blocked job (or the outbox) issues its next spans."""
        if self.outbox:
            self._pump()
        elif self.blocked is not None and self.monitor.can_issue(self.name):
            blocked, self.blocked = self.blocked, None
            self._issue_ready(blocked)
