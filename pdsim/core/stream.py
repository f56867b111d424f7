"""A run that keeps no trace: what passes is checked, folded into the metrics, and let go.

A `Sim` given a `RunStream` holds only what is in flight. Its events, stage rows and decode
steps still go where a run keeps them (the monitor's sink, `stage_rows`, `span_stages`, the
decode record): every `DRAIN_EVENTS` events, at the end of a request, the stream checks the
stages as the end of a run checks them (pdref's `recorded_*`), folds the protocol events
into `RunningMetrics` and the ended decode steps into the inter-token latencies, writes the
per-request rows when asked (`results`), and empties them; then it forgets the requests that
ended. Handled in parts, the same values come out as from a run that kept everything
(tests/test_pdsim_stream.py), in memory that follows the requests in flight.

Faults are not streamed (their outcomes and retries are kept per request: FaultSim).
"""

from __future__ import annotations

import json
import os
from operator import itemgetter

from pdref.metrics import LifeMetrics
from pdref.outfile import create_beside
from pdsim.core.quantiles import EXACT_LIMIT
from pdsim.core.running import RunningMetrics
from pdsim.core.serving_metrics import drain_steps

DRAIN_EVENTS = 1 << 16  # protocol events held before they are folded (a few MB)


class RunStream:
    """What a streamed run keeps of its requests: those in flight, and the running metrics.
    `results`: a path for one JSON line per request, written as each ends (in that order)."""

    def __init__(self, cfg, results: str | None = None, every: int = DRAIN_EVENTS,
                 exact_limit: int = EXACT_LIMIT) -> None:
        self.cfg, self.every = cfg, every
        self.sim = None  # the Sim, set by it (`attach`)
        self.facts: dict[str, tuple[float, int]] = {}  # req in flight -> (arrival, output)
        self.ended: list[str] = []  # reqs released since the last drain
        self.results = _Results(results) if results is not None else None
        self.running = RunningMetrics(cfg.pool_pages, self._facts, exact_limit=exact_limit,
                                      on_ok=None if results is None else self.results.write)
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
        if self.results is not None:
            self.results.close()
        return running

    def abandon(self) -> None:
        """The run failed: nothing half-written stays."""
        if self.results is not None:
            self.results.abandon()


class _Results:
    """`--results` rows written as requests end, to a file renamed into place at the end."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd, self.tmp = create_beside(path)
        self.file = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, life: LifeMetrics, arrival: float, first_token: float) -> None:
        """The row of a request that ended ok (report.request_results' fields)."""
        self.file.write(json.dumps({"req": life.req, "status": "ok", "output": None,
                                    "ttft_s": first_token - arrival,
                                    "e2e_s": life.end_t - arrival, "attempts": 1}) + "\n")

    def close(self) -> None:
        self.file.close()
        os.replace(self.tmp, self.path)

    def abandon(self) -> None:
        self.file.close()
        os.unlink(self.tmp)
