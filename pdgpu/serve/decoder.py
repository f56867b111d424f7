"""The decoder process's loop, in nano-vllm's shape: schedule -> run -> postprocess.

schedule     arrived requests, in arrival order, get a slab as soon as the pool has the pages
             (the head waits rather than being overtaken: no overcommit, no starvation) and go
             to the producer with the least queued prefill work
postprocess  every message of every producer becomes its pdref event through the Ledger (the
             authority): computed, issue, a span's bytes into its slab (land or fail), produced;
             a complete request is admitted when pdref says so; a failed life is aborted once
             its producer stopped, then retried
run          one batched greedy decode forward for every running request, each over its own
             K/V length; a request is released at its output-token count, pages back
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import attrs
import torch

from pdgpu.decode_kv import DecodeBatch, SequenceKV, decode_tokens
from pdgpu.serve.ledger import Ledger
from pdgpu.serve.transport import Message, Transport
from pdgpu.serve.workload import ServeRequest, Workload


class ServeError(RuntimeError):
    """The run cannot go on (a producer failed or went away, no progress); one line."""


@attrs.define
class Life:
    handle: str
    producer: int
    failed: str | None = None  # the first span error
    stopped: bool = False  # the producer confirmed it sends nothing more for this life
    token: int | None = None  # the first output token, once produced
    produced_t: float | None = None

    @property
    def produced(self) -> bool:
        return self.token is not None


@attrs.define
class Tracked:
    """One request across its lives."""

    request: ServeRequest
    arrival: float | None = None
    attempts: int = 0
    status: str = "waiting"  # waiting | prefill | running | ok | failed | cancelled
    life: Life | None = None
    output: list[int] = attrs.Factory(list)
    token_t: list[float] = attrs.Factory(list)
    done_t: float | None = None
    seq: SequenceKV | None = None

    @property
    def req(self) -> str:
        return self.request.req


class Decoder:
    def __init__(self, transport: Transport, ledger: Ledger, model, workload: Workload,
                 prefix_kv: torch.Tensor, retries: int, verify: bool,
                 clock_offsets: dict[int, float], check_peers: Callable[[], None] = lambda: None,
                 progress=None, stall_s: float = 300.0, eos: int | None = None) -> None:
        self.transport, self.ledger, self.model = transport, ledger, model
        self.workload, self.prefix_kv = workload, prefix_kv
        self.retries, self.verify, self.check_peers = retries, verify, check_peers
        self.progress, self.stall_s, self.eos = progress, stall_s, eos
        self.clock_offsets = clock_offsets  # producer clock + offset = this perf_counter
        self.tracked = {r.req: Tracked(r) for r in workload.requests}
        self.future = deque(workload.requests)  # not yet arrived
        self.waiting: deque[Tracked] = deque()
        self.running: list[Tracked] = []
        self.by_handle: dict[str, Tracked] = {}
        self.load = {rank: 0 for rank in transport.peers()}  # queued prefill tokens
        self.announced: dict[int, deque] = {rank: deque() for rank in transport.peers()}
        self.done = 0
        self.last_progress = time.perf_counter()

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        while self.done < len(self.tracked):
            self._arrivals()
            self._postprocess()
            self._schedule()
            if self.running:
                self._decode_step()
            else:
                self._idle()

    def _idle(self) -> None:
        """Nothing to decode: wait for a message (or the next arrival), check the peers."""
        self.check_peers()
        if time.perf_counter() - self.last_progress > self.stall_s:
            raise ServeError(f"no progress for {self.stall_s:.0f} s")
        msg = self.transport.get(timeout=min(0.05, max(0.0, self._next_arrival_in())))
        if msg is not None:
            self._handle(msg)

    def _next_arrival_in(self) -> float:
        arrivals = self.workload.arrivals
        if arrivals is None or not self.future:
            return 0.05
        return arrivals[len(self.tracked) - len(self.future)] - self.ledger.now()

    def _arrivals(self) -> None:
        now = self.ledger.now()
        arrivals = self.workload.arrivals
        while self.future:
            index = len(self.tracked) - len(self.future)
            if arrivals is not None and arrivals[index] > now:
                return
            in_system = index - self.done
            if arrivals is None and in_system >= self.workload.concurrency:
                return
            t = self.tracked[self.future.popleft().req]
            t.arrival = now if arrivals is None else arrivals[index]
            self.waiting.append(t)

    # -- schedule -----------------------------------------------------------------------------

    def _schedule(self) -> None:
        prefix = self.workload.prefix
        while self.waiting and self.ledger.can_reserve(self.waiting[0].request.prompt, prefix):
            t = self.waiting.popleft()
            rank = min(self.load, key=lambda r: (self.load[r], r))
            t.attempts += 1
            t.life = Life(f"{t.req}#{t.attempts}", rank)
            self.ledger.reserve(t.req, t.request.prompt, prefix, f"p{rank}")
            self.by_handle[t.life.handle] = t
            self.load[rank] += t.request.prompt - prefix
            t.status = "prefill"
            self.transport.send(rank, "prefill", {"handle": t.life.handle,
                                                  "tokens": list(t.request.tokens)})

    # -- postprocess --------------------------------------------------------------------------

    def _postprocess(self) -> None:
        while (msg := self.transport.get(timeout=0)) is not None:
            self._handle(msg)

    def _handle(self, msg: Message) -> None:
        self.last_progress = time.perf_counter()
        if msg.op == "error":
            raise ServeError(f"producer p{msg.src}: {msg.body['message']}")
        t = self.by_handle.get(msg.body.get("handle"))
        if t is None:
            raise ServeError(f"producer p{msg.src} sent {msg.op!r} for an unknown request life "
                             f"{msg.body.get('handle')!r}")
        getattr(self, f"_on_{msg.op}")(t, msg)
        self._settle(t)

    def _on_computed(self, t: Tracked, msg: Message) -> None:
        b = msg.body
        self.ledger.computed(t.req, b["layers"], b["tokens"])
        self._stage(t, msg, "compute", b["start"], b["end"])

    def _on_issue(self, t: Tracked, msg: Message) -> None:
        b = msg.body
        span = self.ledger.issue(t.req, b["layers"], b["tokens"], b["bytes"])
        self.announced[msg.src].append((t.req, span))

    def _on_span(self, t: Tracked, msg: Message) -> None:
        req, span = self.announced[msg.src].popleft()
        kv, digests = msg.tensors
        error = self.ledger.land(req, span, kv, digests if self.verify else None)
        self._stage(t, msg, "gather", *msg.body["gather"], span=span)
        self._stage(t, msg, "link", *msg.body["link"], span=span)
        self.transport.send(msg.src, "ack", {"handle": t.life.handle})
        if error is not None and t.life.failed is None:
            t.life.failed = error
            self.transport.send(msg.src, "cancel", {"handle": t.life.handle})

    def _on_produced(self, t: Tracked, msg: Message) -> None:
        self.ledger.produced(t.req, msg.body["token"])
        self._stage(t, msg, "head", msg.body["start"], msg.body["end"])
        t.life.token, t.life.produced_t = msg.body["token"], self.ledger.now()
        self.load[t.life.producer] -= t.request.prompt - self.workload.prefix

    def _on_stopped(self, t: Tracked, msg: Message) -> None:
        t.life.stopped = True
        if not t.life.produced:
            self.load[t.life.producer] -= t.request.prompt - self.workload.prefix

    def _stage(self, t: Tracked, msg: Message, name: str, start, end, span=None) -> None:
        offset = self.clock_offsets[msg.src]
        self.ledger.stage(t.req, name, self.ledger.trace_time(start + offset),
                          self.ledger.trace_time(end + offset), span, f"p{msg.src}")

    def _settle(self, t: Tracked) -> None:
        """After a message: admit a complete life, or end a failed one that has stopped."""
        life = t.life
        if t.status != "prefill":
            return
        if life.failed is None and life.produced and self.ledger.monitor.can_admit(t.req):
            self._admit(t)
        elif life.failed is not None and life.stopped and not self.ledger.in_flight(t.req):
            self._abort(t)

    def _give_back_source(self, t: Tracked) -> None:
        """`reuse`: every span reading the source pages was acknowledged; they may go."""
        self.ledger.reuse(t.req, (self.workload.prefix, t.request.prompt))
        self.transport.send(t.life.producer, "reuse", {"handle": t.life.handle})

    def _admit(self, t: Tracked) -> None:
        self._give_back_source(t)
        context = self.ledger.admit(t.req, self.prefix_kv)  # [L, 2, prompt, KVH, D]
        t.seq = SequenceKV(context, t.request.prompt + t.request.output_tokens)
        t.output = [t.life.token]
        t.token_t = [t.life.produced_t]
        t.status = "running"
        self.running.append(t)
        if self._complete(t):
            self._release(t)

    def _complete(self, t: Tracked) -> bool:
        """At its output-token count, or it just produced the end-of-sequence token."""
        return len(t.output) >= t.request.output_tokens or t.output[-1] == self.eos

    def _abort(self, t: Tracked) -> None:
        self._give_back_source(t)
        self.ledger.abort(t.req, f"copy failed: {t.life.failed}")
        del self.by_handle[t.life.handle]
        if t.attempts <= self.retries:
            t.status = "waiting"
            self.waiting.appendleft(t)  # keeps its place: the oldest request
        else:
            self._finish(t, "failed")

    # -- run ----------------------------------------------------------------------------------

    def _decode_step(self) -> None:
        kv_tokens = sum(t.seq.length for t in self.running)  # read by this step's attention
        batch = DecodeBatch([t.seq for t in self.running])
        start = self.ledger.now()
        tokens = decode_tokens(self.model, batch, [t.output[-1] for t in self.running])
        now = self.ledger.now()
        self.ledger.stage(self.running[0].req, "decode", start, now, resource="decoder",
                          batch=len(self.running), kv_tokens=kv_tokens)
        for t, token in zip(list(self.running), tokens, strict=True):
            t.output.append(token)
            t.token_t.append(now)
            if self._complete(t):
                self._release(t)

    def _release(self, t: Tracked) -> None:
        self.ledger.release(t.req)
        self.running.remove(t)
        del self.by_handle[t.life.handle]
        t.seq = None
        self._finish(t, "ok")

    def _finish(self, t: Tracked, status: str) -> None:
        t.status, t.done_t = status, self.ledger.now()
        self.done += 1
        self.last_progress = time.perf_counter()
        if self.progress is not None:
            self.progress.update(1)

    # -- teardown -----------------------------------------------------------------------------

    def cancel_all(self, reason: str) -> None:
        """After the producers are gone: abort every live life, fence what it left unfenced."""
        for t in self.tracked.values():
            if t.status in ("prefill", "running"):
                self.ledger.abort(t.req, reason)  # cancels its spans in flight
                for span in self.ledger.monitor.unfenced(t.req):
                    self.ledger.fence(t.req, span)  # the transport is torn down: no writer
            if t.status not in ("ok", "failed"):
                t.status = "cancelled"
