"""A simulation with faults (pdsim/core/faults.py): retries, cancellations, producer deaths, and the
outcome of every request (ok / cancelled / failed).

Follows the engine: a life with a failed span computes no further step, lets its other spans
land or fail, waits for every writer's fence, frees its source (`reuse`), `abort`s, and is
retried as a new life (first in the queue) until `--max-attempts` lives were spent. A cancel
`abort`s at once with spans in flight: they are fenced when their writers stop, and the pool
gives the life's pages back only at the last fence. A dead producer is found
`--heartbeat-timeout` after its death: its spans fail and are fenced, its lives aborted and
retried on the others; with none left the requests fail. Pages are never freed here: every
page comes back through a pdref event the Monitor applies.
"""

from __future__ import annotations

import enum

import attrs

from pdref import events as ev
from pdsim.core.config import RequestSpec
from pdsim.core.decoder import Decoder
from pdsim.core.fault_producer import FaultJob, FaultyProducer
from pdsim.core.faults import Draws, FaultSpec
from pdsim.core.sim import Sim, SimResult
from pdsim.core.steps import lower_bound_s


class Status(enum.StrEnum):
    OK = "ok"
    CANCELLED = "cancelled"
    FAILED = "failed"


@attrs.frozen
class Outcome:
    """How one request ended, after how many lives, and why when it did not end ok."""

    req: str
    status: Status
    attempts: int
    t: float  # when it was decided: release, cancel, or the last failure
    reason: str | None = None


@attrs.define(eq=False)
class Ticket:
    """A request across its lives while the run plays it."""

    request: RequestSpec
    cancel_at: float | None  # where in its first life a cancel comes (fraction), or None
    attempts: int = 0
    job: FaultJob | None = None  # its live life
    producer: FaultyProducer | None = None
    outcome: Outcome | None = None


class FaultyDecoder(Decoder):
    """The decoder, telling the FaultSim which requests ended ok."""

    def produced(self, job) -> None:
        if not job.ended:  # a life aborted before the decoder handled its first token
            super().produced(job)

    def try_admit(self, job) -> None:
        if not job.ended:
            super().try_admit(job)


class FaultSim(Sim):
    """A Sim whose producers fail, stall, die and whose requests are cancelled."""

    def __init__(self, cfg, requests, faults: FaultSpec) -> None:
        faults.check_producers(cfg.producers)
        self.faults, self.draws = faults, Draws(faults)
        super().__init__(cfg, requests)
        self.decoder = FaultyDecoder(self.env, self)
        self.tickets = {r.req: Ticket(r, self.draws.cancel_fraction()) for r in self.requests}
        for kill in faults.kills:
            self.env.at(kill.t, self._kill, self.producers[kill.producer])

    def _make_producer(self, name: str) -> FaultyProducer:
        return FaultyProducer(self.env, self, name, self.draws)

    # -- requests ----------------------------------------------------------------------------

    def _arrive(self, request: RequestSpec) -> None:
        if not self._serving():
            self.finish(request.req, Status.FAILED, "no producer left")
            return
        super()._arrive(request)

    def _serving(self) -> bool:
        """Whether a request can still be served: a producer not known dead, or restarts."""
        return self.faults.restart_producers or any(not p.declared_dead
                                                    for p in self.producers)

    def on_start(self, job: FaultJob, producer: FaultyProducer) -> None:
        """A life began (its `reserve`); the first one arms the request's cancel."""
        ticket = self.tickets[job.req]
        ticket.attempts += 1
        ticket.job, ticket.producer = job, producer
        if ticket.attempts == 1 and ticket.cancel_at is not None:
            self.env.after(ticket.cancel_at * self._cancel_window(ticket.request),
                           self._cancel, ticket)

    def _cancel_window(self, request: RequestSpec) -> float:
        """A fault-free life's length: its pipeline lower bound plus its decode."""
        decode = self.output_tokens(request) * self.cfg.costs.decode_token_s
        return lower_bound_s(self.cfg, request) + decode

    def finish(self, req: str, status: Status, reason: str | None = None) -> None:
        ticket = self.tickets[req]
        ticket.job = ticket.producer = None
        ticket.outcome = Outcome(req, status, ticket.attempts, self.env.now, reason)
        self.request_done()

    def released(self, job) -> None:
        self.finish(job.req, Status.OK)
        self.dispatch_between_steps()

    # -- cancellation ------------------------------------------------------------------------

    def _cancel(self, ticket: Ticket) -> None:
        """The client cancels: a queued request leaves the queue, a live one is aborted with
        its spans in flight (its pages are quarantined until they are fenced)."""
        if ticket.outcome is not None:
            return
        job, producer = ticket.job, ticket.producer
        if job is None:  # waiting in the queue for a retry
            self.queue.remove(ticket.request)
        else:
            self.emit(ev.Abort(self.env.now, job.req, "cancelled"))
            self.decoder.drop(job)
            job.ended = True
            producer.cancel_spans(job)
            producer.abandon(job)
            producer.free_source(job)
        self.finish(ticket.request.req, Status.CANCELLED, "cancelled")
        self.dispatch()

    # -- failures ----------------------------------------------------------------------------

    def span_ended(self, job: FaultJob, fenced: bool) -> None:
        """A span of `job` landed or was fenced: a failed life with no writer left ends."""
        if job.failed and not job.ended and not job.runs:
            self._end_failed(job, job.error, free_source=True)
        if fenced:
            self.dispatch()  # a slot, or a quarantined slab, may have come back

    def _end_failed(self, job: FaultJob, reason: str, free_source: bool) -> None:
        """`reuse` (when the producer still holds the source) and `abort`; retry or fail."""
        now, ticket = self.env.now, self.tickets[job.req]
        if free_source:
            self.emit(ev.Reuse(now, job.req, (0, job.request.prompt)))
        self.emit(ev.Abort(now, job.req, reason))
        job.ended = True
        ticket.producer.abandon(job)
        ticket.producer.free_source(job)
        ticket.job = ticket.producer = None
        if ticket.attempts >= self.faults.max_attempts:
            self.finish(job.req, Status.FAILED, f"{reason} ({ticket.attempts} attempts)")
        elif not self._serving():
            self.finish(job.req, Status.FAILED, f"{reason}; no producer left")
        else:
            self.queue.appendleft(job.request)
        self.dispatch()  # the retry, or a request that waited for these pages

    # -- producer death ----------------------------------------------------------------------

    def _kill(self, producer: FaultyProducer) -> None:
        if producer.down:  # already dead (and not yet rejoined): nothing more to kill
            return
        producer.die()
        self.env.after(self.faults.heartbeat_timeout, self._detect, producer)

    def _detect(self, producer: FaultyProducer) -> None:
        """The heartbeat timed out: fail and fence its spans, abort and retry its lives."""
        for job in producer.declare_dead():
            self._end_failed(job, job.error or f"producer {producer.name} lost",
                             free_source=False)
        if not self._serving():
            while self.queue:
                self.finish(self.queue.popleft().req, Status.FAILED, "no producer left")
        if self.faults.restart_producers:
            self.env.after(self.faults.restart_delay, self._rejoin, producer)
        self.dispatch()

    def _rejoin(self, producer: FaultyProducer) -> None:
        producer.rejoin()
        self.dispatch()

    def run(self) -> SimResult:
        result = super().run()
        open_ = [t.request.req for t in self.tickets.values() if t.outcome is None]
        if open_:
            raise RuntimeError(f"pdsim: request {open_[0]} has no outcome at the end of the run")
        leaked = self.cfg.pool_pages - len(self.monitor.free_page_ids())
        outcomes = tuple(t.outcome for t in self.tickets.values())
        return attrs.evolve(result, outcomes=outcomes, leaked_pages=leaked)
