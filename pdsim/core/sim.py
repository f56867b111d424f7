"""One simulation: wires the Env, the Monitor (pdref), producers and the decoder together.

Every event goes through `pdref.monitor.Monitor.emit`, so a schedule the specification
forbids raises a Violation instead of producing a trace.
"""

from __future__ import annotations

from collections import deque

import attrs

from pdref import events as ev
from pdref.monitor import Monitor
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.decoder import Decoder
from pdsim.core.env import Env
from pdsim.core.producer import Producer


@attrs.frozen
class SimResult:
    """What a run leaves: its header, every event in order, and what it was given."""

    cfg: SimConfig
    header: ev.Header
    events: tuple
    requests: tuple[RequestSpec, ...]
    steps: int  # heap events handled
    outcomes: tuple = ()  # with faults: one fault_sim.Outcome per request, in workload order
    leaked_pages: int = 0  # pages not back in the pool at the end


def make_header(cfg: SimConfig) -> ev.Header:
    extra = tuple(sorted((("chunk", cfg.chunk),) + cfg.labels))
    return ev.Header(source="pdsim", mode=cfg.mode, geometry=cfg.geometry,
                     pool_pages=cfg.pool_pages, max_pending=cfg.max_pending, extra=extra)


def check_fits(cfg: SimConfig, requests) -> None:
    """Refuse a workload with a request no pool state could ever hold (it would wait forever)."""
    for r in requests:
        need = cfg.geometry.pages_for(r.prompt - r.prefix)
        if need > cfg.pool_pages:
            raise ValueError(
                f"pool_pages must hold every request: {r.req} needs {need} pages, "
                f"pool has {cfg.pool_pages}")


class Sim:
    """Plays one workload in virtual time; `run()` returns the SimResult."""

    def __init__(self, cfg: SimConfig, requests) -> None:
        check_fits(cfg, requests)
        self.cfg, self.requests = cfg, tuple(requests)
        self.env = Env()
        self.header = make_header(cfg)
        self.events: list = []
        self.monitor = Monitor(self.header, sink=self.events.append)
        self.emit = self.monitor.emit  # the hot path: producers' events straight to the spec
        self.producers = [self._make_producer(cfg.producer_name(i))
                          for i in range(cfg.producers)]
        self.decoder = Decoder(self.env, self)
        self.queue: deque[RequestSpec] = deque()
        self._spans = 0
        # Arrivals enter the heap one at a time (a short heap is a faster heap), each with
        # the sequence number it would have had if all were scheduled now: same order.
        self._arrival_seq = self.env.reserve_seqs(len(self.requests))
        self._arrival_order = sorted(range(len(self.requests)),
                                     key=lambda i: (self.requests[i].arrival, i))
        self._schedule_arrival(0)

    def _schedule_arrival(self, rank: int) -> None:
        """Put the `rank`-th arrival (in time order) on the heap."""
        if rank < len(self._arrival_order):
            index = self._arrival_order[rank]
            self.env.at_seq(self.requests[index].arrival, self._arrival_seq + index,
                            self._next_arrival, rank)

    def _next_arrival(self, rank: int) -> None:
        self._schedule_arrival(rank + 1)
        self._arrive(self.requests[self._arrival_order[rank]])

    def _make_producer(self, name: str) -> Producer:
        return Producer(self.env, self, name)

    def emit(self, event) -> None:
        self.monitor.emit(event)

    def emit_all(self, events) -> None:
        emit = self.monitor.emit
        for event in events:
            emit(event)

    def stage(self, t, req, name, duration, span, resource) -> None:
        self.monitor.emit(ev.Stage(t, req, name, t + duration, span, resource))

    def next_span(self) -> int:
        self._spans += 1
        return self._spans - 1

    def try_admit(self, job) -> None:
        self.decoder.try_admit(job)

    def _arrive(self, request: RequestSpec) -> None:
        self.queue.append(request)
        self.dispatch()

    def dispatch(self) -> None:
        """Start queued requests, in arrival order, on idle producers while a slab fits."""
        while self.queue:
            producer = next((p for p in self.producers if p.idle), None)
            head = self.queue[0]
            if producer is None or not self.monitor.can_reserve(head.prompt, head.prefix):
                return
            producer.start(self.queue.popleft())

    def run(self) -> SimResult:
        self.env.run()
        self.monitor.close()
        return SimResult(self.cfg, self.header, tuple(self.events), self.requests, self.env.steps)


def simulate(cfg: SimConfig, requests, faults=None) -> SimResult:
    """Play `requests`; with an active `faults.FaultSpec`, through `fault_sim.FaultSim`."""
    if faults is None or not faults.active:
        return Sim(cfg, requests).run()
    from pdsim.core.fault_sim import FaultSim  # it builds on Sim

    return FaultSim(cfg, requests, faults).run()
