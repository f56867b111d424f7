"""Synthetic legal traces: many interleaved requests in any mode, with prefix reuse,
failures, cancellations (aborts with spans in flight), fences (version 2), aborts and retries.
Every event goes through a Monitor, so what comes out is legal by construction. Used by the
property tests, the example traces and the benchmark.
"""

from __future__ import annotations

import random

import attrs

from pdref import events as ev
from pdref.monitor import Monitor
from pdref.plan import plan_spans


@attrs.frozen
class SynthConfig:
    """What kind of traffic to make."""

    requests: int = 8
    max_live: int = 3
    min_prompt: int = 1
    max_prompt: int = 200
    chunk: int = 64
    fail_rate: float = 0.05
    retry_rate: float = 0.7
    prefix_rate: float = 0.3
    stages: bool = True
    producers: int = 1
    cancel_rate: float = 0.0  # chance, per move of a request with spans in flight, to abort it


@attrs.define
class _Req:
    req: str
    producer: str
    prompt: int
    prefix: int
    compute: list  # Regions still to compute, in order
    spans: list  # Regions still to issue, in order
    in_flight: list = attrs.Factory(list)  # (span id, Region)
    sent: list = attrs.Factory(list)  # token ranges whose spans are done
    produced: bool = False
    failed: bool = False
    admitted: bool = False


class Synth:
    """Plays random legal traffic through a Monitor; `run()` returns the event list."""

    def __init__(self, header: ev.Header, config: SynthConfig, seed: int) -> None:
        self.header, self.config = header, config
        self.rng = random.Random(seed)
        self.events: list = []
        self.monitor = Monitor(header, self.events.append)
        self.t = 0.0
        self.next_span = 0
        self.started = 0
        self.live: dict[str, _Req] = {}
        self.retries: list[str] = []
        self.unfenced: list[tuple[str, int]] = []  # (req, span) whose writer is not fenced

    def run(self) -> list:
        while (self.started < self.config.requests or self.live or self.retries
               or self.unfenced):
            moves = self._moves()
            if not moves:
                raise RuntimeError("synthetic traffic is stuck (pool too small for max_live?)")
            self.rng.choice(moves)()
        self.monitor.close()
        return self.events

    def _tick(self) -> float:
        self.t += self.rng.choice((0.0, 0.0005, 0.001, 0.003))
        return round(self.t, 6)

    def _emit(self, event) -> None:
        self.monitor.emit(event)

    def _moves(self) -> list:
        moves = []
        if len(self.live) < self.config.max_live and (self.started < self.config.requests
                                                      or self.retries):
            moves.append(self._start)
        for r in list(self.live.values()):
            moves.extend(self._moves_of(r))
        if self.unfenced:
            moves.append(self._fence)
        return moves

    def _moves_of(self, r: _Req) -> list:
        if r.failed:
            return [lambda: self._abort(r)]
        if r.admitted:
            return [lambda: self._release(r)]
        moves = []
        if r.compute:
            moves.append(lambda: self._compute(r))
        if r.spans and self._ready(r) and self.monitor.can_issue(r.producer):
            moves.append(lambda: self._issue(r))
        if r.in_flight:
            moves.append(lambda: self._finish_span(r))
            if self.rng.random() < self.config.cancel_rate:
                moves.append(lambda: self._abort(r, "cancelled"))
        if r.sent and r.produced and not r.spans:
            moves.append(lambda: self._reuse(r))
        if not r.compute and not r.produced:
            moves.append(lambda: self._produce(r))
        if self.monitor.can_admit(r.req):
            moves.append(lambda: self._admit(r))
        return moves

    def _start(self) -> None:
        cfg, rng, geo = self.config, self.rng, self.header.geometry
        prompt = rng.randint(cfg.min_prompt, cfg.max_prompt)
        prefix = 0
        if rng.random() < cfg.prefix_rate:
            prefix = rng.randint(0, prompt // geo.page_tokens) * geo.page_tokens
        if not self.monitor.can_reserve(prompt, prefix):
            return
        if self.retries and rng.random() < 0.5:
            req = self.retries.pop(0)
        else:
            if self.started >= cfg.requests:
                return
            req = f"r{self.started}"
            self.started += 1
        producer = f"p{rng.randrange(cfg.producers)}"
        self.monitor.reserve(self._tick(), req, prompt, prefix, producer)
        self.live[req] = _Req(req, producer, prompt, prefix, self._compute_plan(prompt, prefix),
                              plan_spans(self.header.mode, geo, prompt, prefix, cfg.chunk))

    def _compute_plan(self, prompt: int, prefix: int) -> list:
        spans = plan_spans(self.header.mode, self.header.geometry, prompt, prefix,
                           self.config.chunk)
        if self.header.mode is ev.Mode.LAYER:
            return spans  # layer by layer over the whole suffix
        return plan_spans(ev.Mode.CHUNK, self.header.geometry, prompt, prefix, self.config.chunk)

    def _ready(self, r: _Req) -> bool:
        return self.monitor.state.live(r.req).held.covers(r.spans[0].layers, r.spans[0].tokens)

    def _compute(self, r: _Req) -> None:
        region = r.compute.pop(0)
        t0 = self._tick()
        t1 = self._tick()
        if self.config.stages:
            self._emit(ev.Stage(t0, r.req, "compute", t1, resource="compute"))
        self._emit(ev.Computed(t1, r.req, region.layers, region.tokens))

    def _issue(self, r: _Req) -> None:
        region = r.spans.pop(0)
        span = self.next_span
        self.next_span += 1
        size = region.bytes(self.header.geometry)
        self._emit(ev.Issue(self._tick(), r.req, span, region.layers, region.tokens, size))
        r.in_flight.append((span, region))

    def _finish_span(self, r: _Req) -> None:
        span, region = r.in_flight.pop(self.rng.randrange(len(r.in_flight)))
        t0 = self._tick()
        if self.config.stages:
            self._emit(ev.Stage(t0, r.req, "d2h", self._tick(), span=span, resource="copy"))
        if self.rng.random() < self.config.fail_rate:
            self._emit(ev.Fail(self._tick(), r.req, span, "injected"))
            if self.monitor.state.fences:
                self.unfenced.append((r.req, span))
            r.failed = True
            return
        self._emit(ev.Land(self._tick(), r.req, span))
        if not any(s == span for s, _ in r.in_flight):
            r.sent.append(region.tokens)

    def _reuse(self, r: _Req) -> None:
        tokens = r.sent.pop(0)
        if not any(reg.tokens[0] < tokens[1] and tokens[0] < reg.tokens[1]
                   for _, reg in r.in_flight):
            self._emit(ev.Reuse(self._tick(), r.req, tokens))

    def _produce(self, r: _Req) -> None:
        self._emit(ev.Produced(self._tick(), r.req, self.rng.randrange(1000)))
        r.produced = True

    def _admit(self, r: _Req) -> None:
        self._emit(ev.Admit(self._tick(), r.req))
        r.admitted = True

    def _release(self, r: _Req) -> None:
        self._emit(ev.Release(self._tick(), r.req))
        del self.live[r.req]

    def _abort(self, r: _Req, reason: str = "span failed") -> None:
        self._emit(ev.Abort(self._tick(), r.req, reason))
        if self.monitor.state.fences:  # spans in flight are cancelled: unfenced until fenced
            self.unfenced.extend((r.req, span) for span, _ in r.in_flight)
        del self.live[r.req]
        if self.rng.random() < self.config.retry_rate:
            self.retries.append(r.req)

    def _fence(self) -> None:
        req, span = self.unfenced.pop(self.rng.randrange(len(self.unfenced)))
        self._emit(ev.Fence(self._tick(), req, span))


def synth_trace(header: ev.Header, config: SynthConfig, seed: int = 0) -> list:
    """A legal event list for `header` (all events checked by a Monitor as they are made)."""
    return Synth(header, config, seed).run()
