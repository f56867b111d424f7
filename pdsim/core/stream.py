"""A run that keeps no trace: what passes is checked, folded into the metrics, and let go.

A `Sim` given a `RunStream` holds only what is in flight. Its events, stage rows and decode
steps still go where a run keeps them (the monitor's sink, `stage_rows`, `span_stages`, the
decode record): every `DRAIN_EVENTS` events, at the end of a request, the stream checks the
stages as the end of a run checks them (pdref's `recorded_*`), folds the protocol events
into `RunningMetrics` and the ended decode steps into the inter-token latencies (handing
each request that ended ok to `on_ok`: the per-request rows, when asked), and empties them;
then it forgets the requests that ended and tells `progress` how far the run is. Handled
in parts, the same values come out as from a run that kept everything
(tests/test_pdsim_stream.py), in memory that follows the requests in flight.

Faults are not streamed (their outcomes and retries are kept per request: FaultSim).
"""

from __future__ import annotations

from operator import itemgetter

from pdsim.core.quantiles import EXACT_LIMIT
from pdsim.core.running import RunningMetrics
from pdsim.core.serving_metrics import drain_steps

DRAIN_EVENTS = 1 << 16  # protocol events held before they are folded (a few MB)


class RunStream:
    """What a streamed run keeps of its requests: those in flight, and the running metrics.
    `on_ok(life, arrival, first token's time)`: each request that ended ok (in that order);
    `progress(requests ended, simulated time)`: after each drain."""

    def __init__(self, cfg, on_ok=None, progress=None, every: int = DRAIN_EVENTS,
                 exact_limit: int = EXACT_LIMIT) -> None:
        self.cfg, self.every, self.progress = cfg, every, progress
        self.sim = None  # the Sim, set by it (`attach`)
        self.facts: dict[str, tuple[float, int]] = {}  # req in flight -> (arrival, output)
        self.ended: list[str] = []  # reqs released since the last drain
        self.running = RunningMetrics(cfg.pool_pages, self._facts, exact_limit=exact_limit,
                                      on_ok=on_ok)
        self.running.requests = 0
        self.stage_events = 0

    def attach(self, sim) -> None:
        self.sim = sim

    def arrived(self, request, t: float) -> None:
        """A request entered at `t` (open loop: its arrival; closed loop: its turn)."""
        self.facts[request.req] = (t, self.cfg.output_of(request))
        self.running.requests += 1

    def released(self, req: str) -> None:
        self.ended.append(req)
        if len(self.sim.events) >= self.every:
            self.drain()

    def _facts(self, req: str) -> tuple[float, float, int]:
        arrival, output = self.facts[req]
        return arrival, self.sim.decoder.record.tokens[req][0], output

    def drain(self) -> None:
        """Check and fold what the run holds; forget the requests that ended."""
        sim = self.sim
        self._stages(sim)
        starts, ends = drain_steps(sim.decoder.record, self.running.itl)
        sim.monitor.recorded_stages("decode", starts, ends)
        self.running.track(sim.events)
        sim.events.clear()
        self._forget(sim)
        if self.progress is not None:
            self.progress(self.running.lives, sim.env.now)

    def _stages(self, sim) -> None:
        rows, spans = sim.stage_rows, sim.span_stages
        sim.monitor.recorded_stage_rows(rows)
        sim.monitor.recorded_relative_stages(list(map(itemgetter(3), spans)),
                                             list(map(itemgetter(4), spans)))
        self.stage_events += len(rows) + sum(map(len, map(itemgetter(4), spans)))
        rows.clear()
        spans.clear()

    def _forget(self, sim) -> None:
        decoder = sim.decoder
        for req in self.ended:
            del self.facts[req]
            decoder.record.tokens.pop(req, None)
            decoder.first_token.pop(req, None)
            decoder.admitted.discard(req)
        self.ended.clear()

    def finish(self, sim) -> RunningMetrics:
        """The last drain; the running metrics of the whole run."""
        self.drain()
        running = self.running
        running.open_lives()
        running.events = (running.protocol_events + self.stage_events
                          + (sim.decoder.record.steps if self.cfg.stages else 0))
        return running
