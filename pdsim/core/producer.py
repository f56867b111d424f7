"""The producer process: a queue of reserved requests, a compute stream, and its copier.

Requests come in the order the decoder reserved their slabs (`assign`); the producer computes
them one at a time, each once its source cache has room for the prompt's suffix
(`source_pages`; a life's source pages come back at its `reuse`), as pdgpu serve's producer
does. After each step it emits `computed`, then hands the spans that step made ready to its
sender (sender.py: blocking or queued, then the copier and the span's land). After the last
step the first token's LM head (`head_s`) runs before `produced` (in whole mode the copy
starts after it; in chunk and layer modes the last spans are issued first and their copies
overlap it); the token reaches the decoder `serve_latency_s` later (the serving messages'
round trip: the producer goes on meanwhile, as pdgpu serve's does). A request's life on the
producer is a Job (job.py).
"""

from __future__ import annotations

from collections import deque

import attrs

from pdref.events import Mode
from pdref.plan import Region
from pdref.rows import ComputedRow, new_row
from pdsim.core.config import RequestSpec
from pdsim.core.copier import Copier
from pdsim.core.job import Job
from pdsim.core.sender import Sender
from pdsim.core.steps import Step, plan_steps, upfront_span

__all__ = ["Job", "Producer"]


class Producer(Sender):
    """One producer device: its queue, a compute stream and its copier."""

    def __init__(self, env, sim, name: str) -> None:
        self.env, self.sim, self.name = env, sim, name
        self.cfg = sim.cfg
        self.job: Job | None = None  # the request being computed, None when idle
        self.queue: deque[Job] = deque()  # reserved, waiting for the compute stream
        self.load = 0  # queued prefill work: suffix tokens assigned and not yet produced
        self.source_free = self.cfg.source_pages  # None: an unbounded source cache
        self.blocked: Job | None = None
        self.outbox: deque[tuple[Job, Region]] = deque()  # queued sender: spans to issue
        self.copier = Copier(self.cfg.costs)
        self.gathers: deque[tuple[float, float]] = deque()
        self.lands: deque[float] = deque()  # land times of spans in flight, in FIFO order
        # with land_byte_s or land_contention: bytes of spans in flight
        self.span_bytes: dict[int, int] = {}
        self.lane_prefix = f"{name}."  # a copy stage's resource: producer.lane
        # fixed for the run, looked up once (every step and span reads them)
        cfg = self.cfg
        self.head_s = 0.0 if cfg.no_compute else cfg.costs.head_s
        self.latency_s = cfg.costs.serve_latency_s
        self.whole = cfg.mode is Mode.WHOLE
        self.compute_lane = f"{name}.compute"
        self.bytes_per_token_layer = cfg.geometry.bytes_per_token_layer
        # (contract v3) a geometry with layer kinds: spans priced per kind, states as spans,
        # and (linear layers) each life named a state slot of this producer
        self.hybrid = cfg.geometry.layout is not None
        self.state_slots = self.hybrid and cfg.geometry.recurrent
        self.land_byte_s = cfg.costs.land_byte_s
        # shared host cores: a landing slows the prefill running then (cores.py)
        self.land_slow = cfg.costs.land_contention if sim.cores is not None else 0.0
        self.queued = cfg.sender == "queued"
        self.emit, self.monitor = sim.emit, sim.monitor  # (every step and span: bound once)
        self.cores = sim.cores  # one host's cores shared with others, or None
        self.compute_name = "fill" if cfg.no_compute else "compute"  # export: the payload
        self.stages, self.stage_rows = cfg.stages, sim.stage_rows  # (read on every step and span)
        self.state_bytes = cfg.costs.state_bytes

    @property
    def available(self) -> bool:
        """Whether the decoder sends it requests."""
        return True

    # -- the queue --------------------------------------------------------------------------

    def assign(self, request: RequestSpec, hit=None) -> Job:
        """The decoder reserved the request's slab for this producer: it joins the queue.
        (prefix cache) `hit`: the decoder's cached pages of its leading tokens (its prefix);
        what the producer computes is known when it takes the life (`_plan_with_cache`)."""
        caches = self.sim.caches
        if caches is not None:
            request = attrs.evolve(request, prefix=len(hit) * self.cfg.geometry.page_tokens)
        steps = [] if caches is not None else plan_steps(self.cfg, request, self.sim.chunk_steps)
        job = self._new_job(request, steps)
        # its queued work is its suffix, as pdgpu's decoder counts it (whatever the hit)
        job.owner, job.queued_work = self, request.prompt - request.prefix
        job.compute_from = request.prefix
        slot = self.monitor.free_state_slot(self.name) if self.state_slots else None
        job.slab = self.monitor.reserve(self.env.now, request.req, request.prompt,
                                        request.prefix, self.name, slot,
                                        None if hit is None else tuple(hit))
        if caches is not None:
            caches.reserved(request, hit)
            job.decoder_pages = tuple(hit)
        self.load += job.queued_work
        self.queue.append(job)
        self._start_next()
        return job

    def _new_job(self, request: RequestSpec, steps: list[Step]) -> Job:
        return Job(request, steps, spans_total=sum(len(s.spans) for s in steps))

    def _start_next(self) -> None:
        """An idle compute stream takes the queue's head once its source fits. (prefix
        cache) Its own cache is looked up then, as pdgpu's producer opens a life: pages a
        life ahead of it just computed are hits."""
        if self.job is not None or not self.queue:
            return
        job, caches = self.queue[0], self.sim.caches
        source = () if caches is None else caches.producer_hit(self.name, job.request)
        start = len(source) * self.cfg.geometry.page_tokens if caches is not None \
            else job.request.prefix
        need = self.cfg.geometry.pages_for(job.request.prompt - start)
        if self.source_free is not None:
            if need > self.source_free:
                return
            self.source_free -= need
            job.source_pages = need
        self.job = self.queue.popleft()
        if caches is not None:
            self._plan_with_cache(job, source, start)
        if job.ready:  # (prefix cache) the copy of its producer's cached pages goes first
            self._issue_ready(job)
            return
        self._next_step(job)

    def _plan_with_cache(self, job: Job, source, start: int) -> None:
        """Its producer hit (`source`, the pages of `[0, start)`) is not computed; it computes
        `[start, prompt)` (tokens the decoder holds included: attention needs them) and sends
        `[prefix, prompt)` (pdgpu's serve/producer_cache.py)."""
        request = job.request
        job.steps = plan_steps(self.cfg, request, self.sim.chunk_steps, start)
        job.spans_total = sum(len(s.spans) for s in job.steps)
        job.compute_from = start
        if source:
            self.sim.caches.source_hit(self.name, job, source)
        upfront = upfront_span(self.cfg, request, start)
        if upfront is not None:  # one span copies the hit's pages past the decoder's prefix
            job.ready.append(upfront)
            job.spans_total += 1

    def _unload(self, job: Job) -> None:
        """The job's prefill is no longer queued work (produced, or its life ended)."""
        self.load -= job.queued_work
        job.queued_work = 0

    def free_source(self, job: Job) -> None:
        """`reuse` (or the life's end): its source pages come back; the queue may go on."""
        if self.source_free is not None:
            self.source_free += job.source_pages
        job.source_pages = 0
        self._start_next()

    # -- compute ------------------------------------------------------------------------------

    def _next_step(self, job: Job) -> None:
        if job.index == len(job.steps):
            self._finish(job)
            return
        step = job.steps[job.index]
        duration = self._stretched(step.base_s)
        name = self.compute_name
        if self.cores is not None:  # shared host cores: the stage is known at its end
            self.cores.start(duration, self._shared_end, self._end_step, job.req, name,
                             self.env.now, job, step, prefill=True)
            return
        if self.stages and (duration or not self.cfg.no_compute):  # (Sim.stage inlined)
            now = self.env.now
            self.stage_rows.append((now, job.req, name, now + duration, None, self.compute_lane))
        self.env.after(duration, self._end_step, job, step)

    def _shared_end(self, then, req: str, name: str, start: float, *args) -> None:
        """Compute on shared host cores ended: its stage (start to now), then `then`."""
        if self.stages and (self.env.now > start or not self.cfg.no_compute):
            self.sim.ended_stage(start, req, name, self.compute_lane)
        then(*args)

    def _stretched(self, base: float) -> float:
        """Compute time when known gathers (or other contended copy stages) overlap
        [now, now + base]: contention slows it."""
        now, gathers = self.env.now, self.gathers
        end = now + base
        while gathers and gathers[0][1] <= now:
            gathers.popleft()
        if not gathers:
            return base
        overlap = 0  # (a loop: one or two gathers in flight; a generator costs more)
        for g0, g1 in gathers:
            overlap += max(0.0, (g1 if g1 < end else end) - (g0 if g0 > now else now))
        return base + self.cfg.costs.contention * overlap

    def _end_step(self, job: Job, step: Step) -> None:
        now = self.env.now
        self.emit(new_row(ComputedRow, (now, job.req, step.layers, step.tokens)))
        job.index += 1
        job.ready.extend(step.spans)
        if job.index == len(job.steps) and self.sim.caches is not None:  # what it computed
            self.sim.caches.publish_producer(self.name, job, job.compute_from)
        if job.index == len(job.steps) and self.whole:  # chunk/layer: produced in _finish
            if self.head_s:
                self._run_head(job, self._issue_ready)  # the whole copy starts after it
                return
            self._produce(job)
        self._issue_ready(job)

    def _run_head(self, job: Job, then) -> None:
        """The first token's LM head (after the last step, before `produced`), then `then`."""
        head = self.head_s
        if self.cores is not None:
            self.cores.start(head, self._shared_end, self._head_done, job.req, "head",
                             self.env.now, job, then, prefill=True)
            return
        if self.stages:
            self.sim.stage(self.env.now, job.req, "head", head, None, self.compute_lane)
        self.env.after(head, self._head_done, job, then)

    def _head_done(self, job: Job, then) -> None:
        self._produce(job)
        then(job)

    def _produce(self, job: Job) -> None:
        job.produced = True
        self._unload(job)
        decoder = self.sim.decoder
        if self.latency_s:  # the messages' time: the producer goes on meanwhile
            self.env.after(self.latency_s, decoder.deliver, decoder.produced, job)
        else:
            decoder.deliver(decoder.produced, job)

    def _finish(self, job: Job) -> None:
        if not job.produced and self.head_s:
            self._run_head(job, self._finish)  # chunk/layer: the last copies overlap the head
            return
        if not job.produced:
            self._produce(job)
        self.job = None
        self._start_next()
