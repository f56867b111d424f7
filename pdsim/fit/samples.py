"""Timing samples read back from a trace's `stage` events, for `pdsim calibrate`.

A compute sample pairs a `compute` stage with the `computed` event that closes it (its
region gives tokens and the layer fraction) and the time gathers overlapped it. A copy
sample is one span: its bytes, issue and land times, and its gather / link stages. A fill
sample (export only) pairs a `fill` stage (the payload written) with the `computed` event
that closes it: its duration and bytes. A decode sample is one `decode` stage of a serving
trace (`pdgpu serve`): one batched decode step, its rows and the KV tokens it read.

A serving trace stamps a producer's stages with its own clock moved onto the decoder's
(an offset estimate), so a compute stage may sort after the `computed` event the decoder
logged for it: a request's compute stages and `computed` events are paired in order,
whichever comes first. There a compute sample also counts the producer's idle time since
the request's previous compute stage (its step loop's messages and span hand-offs between
chunks: the simulator's per-chunk cost), and each request's life gives a latency sample: the
decoder's reserve-to-produced time less the producer's first-compute-to-head-end time (the
prefill message's trip to the producer and the first token's back).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict, deque
from itertools import accumulate

import attrs

from pdref.intervals import length
from pdsim.fit.sharing import Running, running_of

SERVE_SOURCE = "pdgpu serve"  # the header `source` of a serving trace
# Fed even for the warm-up request: its life keeps its producer busy for the others
ALWAYS = ("reserve", "produced")
HELD_S = 0.002  # a first token handled this soon after a decode step ended may have waited for it


@attrs.frozen
class ComputeSample:
    duration: float
    fraction: float  # layers computed / all layers
    tokens: tuple[int, int]
    chunks: int  # prefill chunks the region spans (a layer-major step runs every chunk)
    overlap: float  # seconds of gathers (same producer) inside the stage
    masked: float = 0.0  # masked-out pairs of its chunks (dense attention): sum n (n - 1) / 2
    # its stage's span as (seconds, compute activities running, itself included): sharing.py
    running: tuple = ()
    free: float = 1.0  # share of the host's cores other work left its run (sharing.py)
    landed: int = 0  # bytes of spans (any producer's) the decoder landed meanwhile


@attrs.frozen
class DecodeSample:
    """One batched decode step: `batch` requests read `kv_tokens` KV tokens in all."""

    duration: float
    batch: int
    kv_tokens: int
    # its stage's span as (seconds, compute activities running, itself included): sharing.py
    running: tuple = ()
    free: float = 1.0  # share of the host's cores other work left its run (sharing.py)


@attrs.frozen
class HeadSample:
    """One `head` stage: the first token's LM head, and what ran meanwhile (sharing.py)."""

    duration: float
    running: tuple = ()  # (seconds, compute activities running), as ComputeSample's
    free: float = 1.0  # share of the host's cores other work left its run (sharing.py)


@attrs.frozen
class CopySample:
    nbytes: int
    issue: float
    land: float
    stages: tuple[tuple[str, float, float], ...]  # (name, t, end) in time order
    last: bool = False  # the request's last span (the engine harvests it at once)
    produced: float = 0.0  # when its request's prefill finished (`produced`)
    trace: int = 0  # which trace it came from (each trace has its own clock)
    paced: bool = False  # the trace's link was paced (header `link_gbps`): not the raw link
    producer: str = "p0"  # whose copier ran it (each producer has its own lanes)

    def stage(self, name: str) -> tuple[float, float] | None:
        return next(((a, b) for n, a, b in self.stages if n == name), None)


class _Reader:
    def __init__(self, geometry, chunk: int | None, paced: bool = False,
                 serving: bool = False, running: Running | None = None) -> None:
        self.geometry, self.layers = geometry, geometry.layers
        self.running = running or Running([])
        self.chunk, self.paced, self.serving = chunk, paced, serving
        self.reserves: dict[str, list[float]] = defaultdict(list)
        self.compute_span: dict[str, tuple[float, float]] = {}  # req -> first start, last end
        self.head_end: dict[str, float] = {}
        self.skip: str | None = None  # the warm-up request: no sample of its own
        self.decode_spans: list[tuple[float, float]] = []  # decode steps' (t, end)
        self.producer: dict[str, str] = {}
        self.open_compute: dict[str, deque] = defaultdict(deque)
        self.open_fill: dict[str, deque] = defaultdict(deque)
        self.early_computed: dict[str, deque] = defaultdict(deque)  # before their stage
        self.fills: list[tuple[float, int]] = []  # (seconds, bytes) of export payload writes
        self.computes: list[tuple[str, object, object]] = []
        self.issues: dict = {}
        self.span_req: dict = {}
        self.span_stages: dict = defaultdict(list)
        self.copies: list[tuple[str, CopySample]] = []
        self.gathers: dict[str, list] = defaultdict(list)
        self.heads: list[HeadSample] = []  # `head` stages (the first token's LM head)
        self.produced: dict[str, float] = {}
        self.decodes: list[DecodeSample] = []
        self.landings: list[tuple[float, int]] = []  # (land time, bytes)
        self.land_times: list[float] = []
        self.land_sums: list[int] | None = None  # bytes landed before each of land_times

    def feed(self, e) -> None:
        kind = e.kind
        if kind == "reserve":
            self.producer[e.req] = e.producer
            self.reserves[e.req].append(e.t)
        elif kind == "stage":
            self._stage(e)
        elif kind == "computed":
            self._computed(e)
        elif kind == "issue":
            self.issues[e.span] = e
            self.span_req[e.span] = e.req
        elif kind == "land":
            self._land(e)
        elif kind == "produced":
            self.produced[e.req] = e.t

    def _computed(self, e) -> None:
        if self.open_compute[e.req]:
            self.computes.append((self.producer.get(e.req, "p0"),
                                  self.open_compute[e.req].popleft(), e))
        elif self.open_fill[e.req]:
            fill = self.open_fill[e.req].popleft()
            self.fills.append((fill.end - fill.t, self.geometry.region_bytes(e.layers, e.tokens)))
        else:  # a serving trace: its compute stage sorts later (another clock)
            self.early_computed[e.req].append(e)

    def _compute_stage(self, e) -> None:
        first, last = self.compute_span.get(e.req, (e.t, None))
        lead = max(0.0, e.t - last) if self.serving and last is not None else 0.0
        self.compute_span[e.req] = (first, e.end)
        if self.early_computed[e.req]:
            self.computes.append((self.producer.get(e.req, "p0"), (e, lead),
                                  self.early_computed[e.req].popleft()))
        else:
            self.open_compute[e.req].append((e, lead))

    def _stage(self, e) -> None:
        if e.name == "compute":
            self._compute_stage(e)
        elif e.name == "decode":
            self.decode_spans.append((e.t, e.end))
            if e.batch is not None and e.kv_tokens is not None:
                self.decodes.append(DecodeSample(e.end - e.t, e.batch, e.kv_tokens,
                                                 self.running.segments(e.t, e.end)))
        elif e.name == "fill":
            self.open_fill[e.req].append(e)
        elif e.name == "head":
            self.heads.append(HeadSample(e.end - e.t, self.running.segments(e.t, e.end)))
            self.head_end[e.req] = e.end
        elif e.span is not None:
            self.span_stages[e.span].append((e.name, e.t, e.end))
            if e.name == "gather":
                self.gathers[self.producer.get(e.req, "p0")].append((e.t, e.end))

    def _land(self, e) -> None:
        issue = self.issues.pop(e.span, None)
        if issue is not None:
            self.landings.append((e.t, issue.bytes))
            self.copies.append((e.span, CopySample(issue.bytes, issue.t, e.t, ())))

    def compute_samples(self) -> list[ComputeSample]:
        out = []
        for producer, (stage, lead), done in self.computes:
            overlap = sum(max(0.0, min(b, stage.end) - max(a, stage.t))
                          for a, b in self.gathers[producer])
            n = length(done.tokens)
            chunks = -(-n // self.chunk) if self.chunk else 1
            out.append(ComputeSample(stage.end - stage.t + lead,
                                     length(done.layers) / self.layers,
                                     done.tokens, chunks, overlap, self._masked(n),
                                     self.running.segments(stage.t, stage.end),
                                     landed=self._landed(stage.t, stage.end)))
        return out

    def _landed(self, a: float, b: float) -> int:
        """Bytes of the spans the decoder landed while [a, b] ran (not at its ends: a span
        landing as a chunk starts or ends is not beside it)."""
        if not self.landings:
            return 0
        if self.land_sums is None:  # once, when every land has been read
            self.landings.sort()
            self.land_times = [t for t, _ in self.landings]
            self.land_sums = list(accumulate((n for _, n in self.landings), initial=0))
        sums, times = self.land_sums, self.land_times
        return sums[bisect_left(times, b)] - sums[bisect_right(times, a)]  # (a, b): inside

    def latencies(self) -> list[float]:
        """Serving traces: per one-life request whose producer was idle when it was reserved
        (every earlier request on that producer had produced) and whose first token no
        decode step may have held (`_held`), reserve-to-produced (decoder's clock) less first
        compute to head end (producer's clock): the messages' round trip, with no wait behind
        another prefill or a decode step in it (the simulator plays those waits itself).
        Decode steps during its prefill do not disqualify it: the round trip under a busy
        decoder is what most requests of a closed loop with C > 1 see."""
        if not self.serving:
            return []
        out, busy_until = [], defaultdict(float)  # producer -> last produced so far
        lives = sorted((times[0], req) for req, times in self.reserves.items()
                       if len(times) == 1 and req in self.produced)
        for reserved, req in lives:
            producer = self.producer.get(req, "p0")
            idle = busy_until[producer] <= reserved
            busy_until[producer] = max(busy_until[producer], self.produced[req])
            idle = idle and not self._held(self.produced[req])
            if idle and req != self.skip and req in self.head_end and req in self.compute_span:
                prefill = self.head_end[req] - self.compute_span[req][0]
                out.append(self.produced[req] - reserved - prefill)
        return out

    def _held(self, produced: float) -> bool:
        """Whether the decoder may have held this first token behind a decode step: one
        ran when it was handled or ended just before (pdgpu's loop reads its messages only
        between steps; after a gap longer than HELD_S it was idle, reading at once)."""
        return any(a < produced <= b + HELD_S for a, b in self.decode_spans)

    def _masked(self, n: int) -> float:
        """Masked pairs of n tokens cut into chunks of `chunk` (the last one shorter)."""
        size = self.chunk or n
        full, rest = divmod(n, size)
        return full * size * (size - 1) / 2 + rest * (rest - 1) / 2

    def copy_samples(self) -> list[CopySample]:
        """Spans that moved bytes and reported stages; `last` marks each request's final one."""
        out, seen = [], set()
        for span, c in reversed(self.copies):
            req = self.span_req[span]
            stages = tuple(sorted(self.span_stages[span], key=lambda s: s[1]))
            if c.nbytes > 0 and stages:
                out.append(attrs.evolve(c, stages=stages, last=req not in seen,
                                        paced=self.paced, produced=self.produced.get(req, 0.0),
                                        producer=self.producer.get(req, "p0")))
                seen.add(req)
        return out[::-1]


@attrs.frozen
class TraceSamples:
    computes: list[ComputeSample]
    copies: list[CopySample]
    heads: list[HeadSample]
    fills: list[tuple[float, int]]
    decodes: list[DecodeSample] = attrs.Factory(list)
    latencies: list[float] = attrs.Factory(list)  # serving traces: seconds, one per request


def samples(header, events, skip_warmup: bool = True) -> TraceSamples:
    """Samples of one trace (events in trace order). With several requests, the first is the
    engine's warm-up (cold buffers, first-touch page faults) and is left out; decode steps
    are the batch's, not that request's, and all kept."""
    chunk = header.get("chunk")
    events = list(events)
    reader = _Reader(header.geometry, chunk if isinstance(chunk, int) else None,
                     paced=bool(header.get("link_gbps")), serving=header.source == SERVE_SOURCE,
                     running=running_of(events))
    reqs = list(dict.fromkeys(e.req for e in events if e.kind == "reserve"))
    skip = reqs[0] if skip_warmup and len(reqs) > 1 else None
    reader.skip = skip
    for e in events:
        if skip is None or e.req != skip or e.kind in ALWAYS or (
                e.kind == "stage" and e.name == "decode"):
            reader.feed(e)
    return TraceSamples(reader.compute_samples(), reader.copy_samples(), reader.heads,
                        reader.fills, reader.decodes, reader.latencies())
