"""One simulation: wires the Env, the Monitor (pdref), producers and the decoder together.

Every event goes through `pdref.fast_monitor.FastMonitor.emit` (pdref's Monitor, same
verdicts, on a mutable mirror of the state), so a schedule the specification forbids raises
a Violation instead of producing a trace.

Scheduling follows `pdgpu serve`'s decoder: arrived requests, in arrival order, get a slab
as soon as the pool has its pages (the head waits rather than being overtaken) and go to the
producer with the least queued prefill work (suffix tokens not yet produced; ties: the lower
index), which computes its queue in order. Arrivals are open loop (each request's `arrival`)
or closed loop (`concurrency`: the first C enter at 0, each finished request lets the next
one in at that moment).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from functools import cached_property
from operator import attrgetter, itemgetter

import attrs

from pdref import events as ev
from pdref.fast_monitor import FastMonitor
from pdref.rows import as_event
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.cores import HostCores
from pdsim.core.decoder import Decoder, DecodeRecord
from pdsim.core.env import Env
from pdsim.core.prefix_cache import PrefixCaches
from pdsim.core.producer import Producer


@attrs.frozen
class SimResult:
    """What a run leaves: its header, its checked events, and what it was given.

    Stage events (informational: they change no state) are kept as rows, not as events in
    time order: a run makes four or more per span, and ordering them on the event heap and
    building each as an event object cost a quarter of a run that never looks at them.
    `events` builds them and merges them by time when something reads them."""

    cfg: SimConfig
    header: ev.Header
    # every protocol event (no stage), in the order checked; the per-span ones (computed,
    # issue, land) as pdref.rows, which metrics fold as the events (`protocol`: all events)
    protocol_rows: tuple
    requests: tuple[RequestSpec, ...]  # closed loop: each with the time it entered
    steps: int  # heap events handled
    outcomes: tuple = ()  # with faults: one fault_sim.Outcome per request, in workload order
    leaked_pages: int = 0  # pages not back in the pool at the end
    decode: DecodeRecord = attrs.Factory(DecodeRecord)  # the decode batch's steps
    stage_rows: tuple = ()  # (t, req, name, end, span, resource) of each stage, any order
    # a span's copy stages, one entry per span: (req, span, resource prefix, base,
    # ((name, t - base, end - base), ...)); a serial copier's spans of a size share the offsets
    span_stages: tuple = ()
    # a streamed run (stream.py): its metrics, folded while it ran; it kept no event, no
    # stage and no request
    running: object = None
    # (prefix cache) prompt tokens looked up and found: prefix_cache_queries,
    # prefix_cache_hits (the decoder's), producer_prefix_cache_hits
    prefix_cache: tuple = ()

    @cached_property
    def protocol(self) -> tuple:
        """Every protocol event (no stage), in the order checked."""
        return tuple(map(as_event, self.protocol_rows))

    @cached_property
    def events(self) -> tuple:
        """Every checked event in time order: protocol events and the stages (decode steps
        aside: `trace_events`); among equal times the protocol events come first, then the
        stages in the order the run made them."""
        if not self.stage_rows and not self.span_stages:
            return self.protocol
        copies = [(base + t, req, name, base + end, span, prefix + name)
                  for req, span, prefix, base, stages in self.span_stages
                  for name, t, end in stages]
        rows = sorted([*self.stage_rows, *copies], key=itemgetter(0))
        stages = [ev.Stage(*row) for row in rows]
        return tuple(heapq.merge(self.protocol, stages, key=_time))

    @property
    def event_count(self) -> int:
        """Checked events, decode steps aside."""
        return (len(self.protocol_rows) + len(self.stage_rows)
                + sum(map(len, map(itemgetter(4), self.span_stages))))

    def trace_events(self):
        """Every event of the trace in time order: the checked events, and (with stage
        events on) the decode steps as `decode` stages (the first among equal times)."""
        if not self.cfg.stages or not self.decode.steps:
            return iter(self.events)
        return heapq.merge(self.events, self.decode.stages(), key=_time)


_time = attrgetter("t")


def make_header(cfg: SimConfig) -> ev.Header:
    extra = tuple(sorted((("chunk", cfg.chunk),) + cfg.labels))
    header = ev.Header(source="pdsim", mode=cfg.mode, geometry=cfg.geometry,
                       pool_pages=cfg.pool_pages, max_pending=cfg.max_pending, extra=extra)
    if cfg.prefix_cache:  # its pages are named: contract v4
        return attrs.evolve(header, version=ev.CACHE_VERSION)
    return header


def check_fits(cfg: SimConfig, requests) -> None:
    """Refuse a workload with a request no pool state could ever hold (it would wait forever)."""
    for r in requests:
        if cfg.prefix_cache and r.prefix:
            raise ValueError(f"prefix: with a prefix cache the cache finds each request's "
                             f"prefix; {r.req} gives prefix {r.prefix}")
        need = cfg.geometry.pages_for(r.prompt - r.prefix)
        if need > cfg.pool_pages:
            raise ValueError(
                f"pool_pages must hold every request: {r.req} needs {need} pages, "
                f"pool has {cfg.pool_pages}")
        if cfg.source_pages is not None and cfg.geometry.pages_for(r.prompt) > cfg.source_pages:
            raise ValueError(
                f"source_pages must hold every prompt: {r.req} needs "
                f"{cfg.geometry.pages_for(r.prompt)} pages, a producer has {cfg.source_pages}")


# arrivals' sequence numbers: below every other event's, so among equal times they come first
_ARRIVAL_SEQ = -(1 << 62)


class Sim:
    """Plays one workload in virtual time; `run()` returns the SimResult. With a `stream`
    (stream.RunStream) it keeps only what is in flight: `requests` may then be any iterable
    in arrival order (read as the run goes), and the result holds the running metrics."""

    def __init__(self, cfg: SimConfig, requests, stream=None) -> None:
        self.stream = stream
        # sessions (sessions.py): a request's next turn, (think seconds, RequestSpec), played
        # once it is released
        self.followups: dict = dict(getattr(requests, "followups", {}))
        if stream is None:
            requests = tuple(requests)
            check_fits(cfg, requests + tuple(turn for _, turn in self.followups.values()))
        else:
            stream.attach(self)
        self.cfg, self.requests = cfg, requests
        self.env = Env()
        self.header = make_header(cfg)
        self.events: list = []
        self.stage_rows: list = []  # (t, req, name, end, span, resource): checked at the end
        self.span_stages: list = []  # copy stages, one entry per span (SimResult.span_stages)
        # the specification's verdicts on a mutable mirror of its state (fast_monitor.py)
        sink = self.events.append  # (streamed: span ids kept without owners, mirror.py)
        self.monitor = (FastMonitor(self.header, sink=sink) if stream is None
                        else FastMonitor(self.header, sink=sink, lean=True))
        # one host's cores shared by every producer's compute and the decoder's steps
        host_cores = cfg.costs.host_cores
        self.cores = HostCores(self.env, host_cores) if host_cores is not None else None
        self.emit = self.monitor.emit  # the hot path: producers' events straight to the spec
        # (contract v4) both sides' prefix caches, or None
        self.caches = PrefixCaches(self) if cfg.prefix_cache else None
        self.later: list[RequestSpec] = []  # the turns that arrived after a previous one
        self.chunk_steps: dict = {}  # steps.plan_steps' memo: a chunk's Step by its tokens
        self.producers = [self._make_producer(cfg.producer_name(i))
                          for i in range(cfg.producers)]
        self.decoder = Decoder(self.env, self)
        self.queue: deque[RequestSpec] = deque()
        self.next_span = itertools.count().__next__  # span ids 0, 1, 2 ... in issue order
        self.entered: dict[str, float] = {}  # closed loop: when each request came in
        self._waiting = iter(requests)  # requests not yet arrived (open loop: in time order)
        if cfg.concurrency is None:
            if stream is None:  # (ties: workload order)
                self._waiting = iter(sorted(requests, key=attrgetter("arrival")))
            self._schedule_arrival(0)
        else:
            self.env.at(0.0, self._let_in, cfg.concurrency)

    # -- arrivals ---------------------------------------------------------------------------

    def _schedule_arrival(self, rank: int) -> None:
        """Put the next arrival, the `rank`-th, on the heap: arrivals enter it one at a time
        (a short heap is a faster heap)."""
        request = next(self._waiting, None)
        if request is not None:
            self.env.at_seq(request.arrival, _ARRIVAL_SEQ + rank, self._next_arrival, request,
                            rank)

    def _next_arrival(self, request: RequestSpec, rank: int) -> None:
        self._schedule_arrival(rank + 1)
        self._arrive(request)

    def _let_in(self, count: int) -> None:
        """Closed loop: the next `count` requests enter now."""
        for request in itertools.islice(self._waiting, count):
            if self.stream is None:
                self.entered[request.req] = self.env.now
            self._arrive(request)

    def request_done(self) -> None:
        """A request finished (ok, failed or cancelled): closed loop, the next one enters."""
        if self.cfg.concurrency is not None:
            self._let_in(1)

    def _arrive(self, request: RequestSpec) -> None:
        if self.stream is not None:
            check_fits(self.cfg, (request,))
            self.stream.arrived(request, self.env.now)
        self.queue.append(request)
        self.dispatch_between_steps()  # pdgpu's loop reserves between decode steps

    # -- the decoder's schedule ---------------------------------------------------------------

    def dispatch(self) -> None:
        """Reserve slabs for queued requests in arrival order while the pool has the head's
        pages; each goes to the producer with the least queued prefill work."""
        while self.queue:
            head = self.queue[0]
            if self.caches is None:
                if not self.monitor.can_reserve(head.prompt, head.prefix):
                    return
                hit = None
            else:  # its cached leading pages; idle cached pages give room (LRU)
                hit = self.caches.decoder_hit(head)
                need = self.cfg.geometry.pages_for(head.prompt - len(hit) * self.caches.pt)
                if not self.caches.room(need, set(hit)):
                    return
            producer = self._least_queued()
            if producer is None:
                return
            producer.assign(self.queue.popleft(), hit)

    def _least_queued(self) -> Producer | None:
        best = None
        for producer in self.producers:
            if producer.available and (best is None or producer.load < best.load):
                best = producer
        return best

    # -- what producers and the decoder call ----------------------------------------------------

    def _make_producer(self, name: str) -> Producer:
        return Producer(self.env, self, name)

    def stage(self, t, req, name, duration, span, resource) -> None:
        """A stage from `t` for `duration`: recorded, checked at the end of the run."""
        self.stage_rows.append((t, req, name, t + duration, span, resource))

    def ended_stage(self, t, req, name, resource) -> None:
        """A stage that started at `t` and ends now (its length known only now: shared
        cores)."""
        self.stage_rows.append((t, req, name, self.env.now, None, resource))

    def try_admit(self, job) -> None:
        self.decoder.try_admit(job)

    def output_tokens(self, request: RequestSpec) -> int:
        return self.cfg.output_of(request)

    def released(self, job) -> None:
        """An admitted request finished decoding (its `release` is emitted)."""
        if self.stream is not None:
            self.stream.released(job.req)
        follow = self.followups.pop(job.req, None)
        if follow is not None:  # a session's next turn, after the user's think time
            think, request = follow
            self.env.at(self.env.now + think, self._turn, request)
        self.request_done()
        self.dispatch_between_steps()

    def _turn(self, request: RequestSpec) -> None:
        """A session's next turn arrives (its arrival: now)."""
        request = attrs.evolve(request, arrival=self.env.now)
        if self.stream is None:
            self.later.append(request)
        self._arrive(request)

    def dispatch_between_steps(self) -> None:
        """`dispatch` now, unless a decode step runs (then its end dispatches)."""
        if not self.decoder.stepping:
            self.dispatch()

    def run(self) -> SimResult:
        if self.stream is not None:
            return self._run_streamed()
        self.env.run()
        record = self.decoder.record  # its steps become the trace's `decode` stages: checked
        self.monitor.recorded_stages("decode", record.step_start, record.step_end)
        self.monitor.recorded_stage_rows(self.stage_rows)
        spans = self.span_stages
        self.monitor.recorded_relative_stages(list(map(itemgetter(3), spans)),
                                              list(map(itemgetter(4), spans)))
        self.monitor.close()
        requests = tuple(self.requests) + tuple(self.later)
        if self.entered:
            requests = tuple(attrs.evolve(r, arrival=self.entered.get(r.req, r.arrival))
                             for r in requests)
        return SimResult(self.cfg, self.header, tuple(self.events), requests, self.env.steps,
                         leaked_pages=self.leaked_pages(), prefix_cache=self._cache_counts(),
                         decode=self.decoder.record, stage_rows=tuple(self.stage_rows),
                         span_stages=tuple(self.span_stages))

    def _cache_counts(self) -> tuple:
        caches = self.caches
        if caches is None:
            return ()
        return (("prefix_cache_queries", caches.queries), ("prefix_cache_hits", caches.hits),
                ("producer_prefix_cache_hits", caches.producer_hits))

    def leaked_pages(self) -> int:
        """Pages neither free nor in the decoder's prefix cache at the end (cached pages are
        not leaked: the decoder may evict them at any time)."""
        return (self.cfg.pool_pages - len(self.monitor.free_page_ids())
                - len(self.monitor.cached()))

    def _run_streamed(self) -> SimResult:
        self.env.run()
        running = self.stream.finish(self)
        self.monitor.close()
        return SimResult(self.cfg, self.header, (), (), self.env.steps,
                         leaked_pages=self.leaked_pages(), prefix_cache=self._cache_counts(),
                         decode=self.decoder.record, running=running)

