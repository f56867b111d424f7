"""The decoder process's loop, in nano-vllm's shape: schedule -> run -> postprocess.

schedule     arrived requests, in arrival order, get a slab as soon as the pool has the pages
             (the head waits rather than being overtaken: no overcommit, no starvation) and go
             to the serving producer with the least queued prefill work
postprocess  every message of every producer becomes its pdref event through the Ledger (the
             authority; postprocess.py, a part that owns its own state); a complete request
             is admitted when pdref says so: its context gathered once from where it landed
             into its decode row (decode_kv.py); faults (recovery.py, a part too): failed
             lives, cancels, deadlines, dead producers
run          one batched decode forward for every running request, each over its own K/V
             length, its token drawn by the request's own options (greedy unless it samples;
             sampler.py); a request is released at its output-token count, pages back
"""

from __future__ import annotations

import time
from collections import deque

import attrs
import torch

from pdgpu.decode_batch import DecodeBatch, Forward, decode_logits, decode_tokens
from pdgpu.decode_kv import DecodeCache
from pdgpu.generate import step_at, stop_tokens
from pdgpu.prefix_index import KeyChain
from pdgpu.sampler import Sampler
from pdgpu.serve.decoder_prefix import DecoderPrefix
from pdgpu.serve.faults import FaultPolicy, FaultSpec
from pdgpu.serve.ledger import Ledger
from pdgpu.serve.lives import Life, Status, Tracked
from pdgpu.serve.members import Members
from pdgpu.serve.postprocess import Postprocess
from pdgpu.serve.recovery import Recovery, ServeError, expected_steps
from pdgpu.serve.workload import ServeRequest, Workload

__all__ = ["Decoder", "ServeError"]


class Decoder:
    def __init__(self, ledger: Ledger, model, workload: Workload, members: Members,
                 policy: FaultPolicy, faults: FaultSpec, verify: bool,
                 progress=None, stall_s: float = 300.0, eos: int | None = None,
                 inbox=None, forward: Forward = decode_logits,
                 prefix_cache: DecoderPrefix | None = None) -> None:
        self.ledger, self.model, self.members = ledger, model, members
        self.forward = forward  # the decode step: eager, or replayed (decode_graph.py)
        self.prefix_cache = prefix_cache  # the automatic prefix cache over the pool, or None
        self.workload = workload
        self.progress, self.stall_s, self.eos = progress, stall_s, eos
        self.tracked = {r.req: Tracked(r) for r in workload.requests}
        for t in self.tracked.values():
            t.cancel_at = faults.cancel_step(t.req, expected_steps(ledger.header, t.request,
                                                                   workload.prefix))
        self.future = deque(workload.requests)  # not yet arrived
        self.waiting: deque[Tracked] = deque()
        self.running: list[Tracked] = []
        # the running requests' K/V (their states in the pool they landed in)
        self.decode_cache = DecodeCache.for_model(model, states=ledger.kv_landing.states)
        self.sampler = Sampler(model.spec.vocab, self.decode_cache.device)
        self.lives: dict[str, Life] = {}  # handle -> a life its producer may still send for
        self.recovery = Recovery(ledger, members, policy, self.tracked,
                                 self.waiting, self.lives, self._finish, self._leave_batch)
        self.postprocess = Postprocess(ledger, members, self.recovery, self.tracked, self.lives,
                                       verify, self._admit)
        self.done = 0
        self.last_progress = time.perf_counter()
        self.inbox = inbox  # the HTTP front end's bridge (frontend.py), or None: batch mode
        self.idle_s = 0.02 if inbox is None else inbox.idle_s  # longest wait with nothing to do
        self.on_end = None  # called with each request as it ends (`--results`, live)

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        while self.done < len(self.tracked) or self._writers_busy() or self._open():
            self._arrivals()
            self.postprocess.drain()
            if self.inbox is not None:  # requests in; tokens, ends and cancels out
                self.inbox.pump(self)
            self.recovery.watch()
            self._schedule()
            if self.running:
                self._decode_step()
            else:
                self._idle()
        if self.prefix_cache is not None:  # every page of the pool free at the end
            self.prefix_cache.drain()

    def _writers_busy(self) -> bool:
        """An ended life still has spans whose writer may write (unfenced): the loop waits
        for its producer's word (the late bytes, or `stopped`) and fences them, so that the
        trace never closes with a writer unfenced (LIFE-1; a request cancelled last ended
        the loop before its producer had stopped)."""
        return any(life.unfenced for life in self.lives.values())

    def _open(self) -> bool:
        """The HTTP front end still takes requests or has some in flight."""
        return self.inbox is not None and self.inbox.serving()

    def arrive(self, request: ServeRequest, stop=()) -> Tracked:
        """A request submitted while the loop runs (the HTTP front end): it arrives now and
        also ends after any token of `stop`."""
        t = Tracked(request, stop=frozenset(stop))
        t.arrival = self.ledger.now()
        self.tracked[t.req] = t
        self.waiting.append(t)
        self.last_progress = time.perf_counter()
        return t

    def cancel(self, req: str) -> None:
        """Cancel request `req` (thread-safe: applied by the loop at its next turn)."""
        self.recovery.cancel(req)

    def cancel_all(self, reason: str) -> None:
        """After the producers are gone (the ledger stopped): every live life aborted."""
        self.recovery.cancel_all(reason)

    def finish_early(self, t: Tracked) -> None:
        """A decoding request its client has all it wants of (a stop string): released,
        ok, like one at its output-token count."""
        if t.status is Status.RUNNING:
            self._release(t)

    def _idle(self) -> None:
        """Nothing to decode: wait for a message (or the next arrival)."""
        if time.perf_counter() - max(self.last_progress, self.postprocess.last_message) \
                > self.stall_s:
            raise ServeError(f"no progress for {self.stall_s:.0f} s")
        msg = self.members.transport.get(timeout=min(self.idle_s,
                                                     max(0.0, self._next_arrival_in())))
        if msg is not None:
            self.postprocess.handle(msg)

    def _next_arrival_in(self) -> float:
        arrivals = self.workload.arrivals
        if arrivals is None or not self.future:
            return self.idle_s
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
            if t.status is Status.WAITING:  # not cancelled before it arrived
                self.waiting.append(t)
                self.recovery.step(t, count=0)

    # -- schedule -----------------------------------------------------------------------------

    def _load(self, rank: int) -> int:
        """Prefill tokens queued on a producer."""
        return sum(life.suffix for life in self.lives.values()
                   if life.producer == rank and life.prefilling)

    def _schedule(self) -> None:
        while self.waiting:
            t = self.waiting[0]
            hit = () if self.prefix_cache is None else self.prefix_cache.lookup(self._keys(t))
            prefix = len(hit) * self.ledger.geometry.page_tokens if hit else \
                self.workload.prefix
            ready = self._room(t, prefix, hit) and self.members.ready()
            if not ready:
                return
            rank = min(ready, key=lambda r: (self._load(r), r))
            self.waiting.popleft()
            self._reserve(t, rank, prefix, hit)

    def _keys(self, t: Tracked) -> KeyChain:
        """`t`'s prompt's key chain, made at its first look-up and kept until it is admitted:
        each of its pages is hashed once however many turns it waits for room."""
        if t.keys is None:
            t.keys = self.prefix_cache.chain(t.request.tokens)
        return t.keys

    def _room(self, t: Tracked, prefix: int, hit: tuple[int, ...]) -> bool:
        """The pool has the slab's pages, or frees them by evicting idle cached pages."""
        prompt = t.request.prompt
        return self.ledger.can_reserve(prompt, prefix) or (
            self.prefix_cache is not None and self.prefix_cache.room(
                t.req, self.ledger.geometry.pages_for(prompt - prefix), hit))

    def _reserve(self, t: Tracked, rank: int, prefix: int, hit: tuple[int, ...]) -> None:
        """`t`'s next life: its slab (after its cache hit), then its producer told."""
        t.attempts += 1
        t.life = Life(f"{t.req}#{t.attempts}", t.req, rank, t.request.prompt - prefix, prefix)
        state_slot = self.ledger.reserve(t.req, t.request.prompt, prefix, f"p{rank}",
                                         hit or None)
        if self.prefix_cache is not None:
            self.prefix_cache.reserved(t.req, t.request.prompt, hit)
        self.lives[t.life.handle] = t.life
        t.status, t.reserved_t = Status.PREFILL, self.ledger.now()
        self.members.send(rank, "prefill", {
            "handle": t.life.handle, "req": t.req, "tokens": list(t.request.tokens),
            "prefix": prefix, "sampling": attrs.asdict(t.request.sampling),
            "ban": list(self._draw(t, 0).ban), "state_slot": state_slot})

    # -- admission ----------------------------------------------------------------------------

    def _admit(self, t: Tracked) -> None:
        life = t.life
        self.ledger.reuse(t.req, (life.prefix, t.request.prompt))
        del self.lives[life.handle]
        self.members.send(life.producer, "reuse", {"handle": life.handle})
        context = self.ledger.admit(t.req)
        t.seq = self.decode_cache.add_paged(context.parts, context.state_slot)  # the one copy
        if self.prefix_cache is not None:  # its slab's new whole pages, for later requests
            self.prefix_cache.publish(t.req, self._keys(t), life.prefix,
                                      self.ledger.slabs[t.req])
            t.decoder_hit, t.keys = life.prefix, None
        t.slot = self.sampler.open(t.request.sampling, t.request.tokens, [life.token])
        t.output = [life.token]
        t.logprobs = [] if life.logprob is None else [life.logprob]
        t.token_t = [life.produced_t]
        t.status, t.life, t.admitted_t = Status.RUNNING, None, self.ledger.now()
        self.running.append(t)
        if self._complete(t):
            self._release(t)

    def _complete(self, t: Tracked) -> bool:
        """At its output-token count, or it just produced the end-of-sequence token."""
        return len(t.output) >= t.request.output_tokens or t.output[-1] in self._stops(t)

    def _stops(self, t: Tracked) -> frozenset[int]:
        return stop_tokens(t.request.sampling, self.eos, t.stop)

    def _draw(self, t: Tracked, position: int):
        """The sampler's row for `t`'s output token `position`."""
        return step_at(t.request.sampling, position, self._stops(t), t.slot)

    # -- run ----------------------------------------------------------------------------------

    def _decode_step(self) -> None:
        kv_tokens = sum(t.seq.length for t in self.running)  # read by this step's attention
        batch = DecodeBatch([t.seq for t in self.running])
        start = self.ledger.now()
        steps = [self._draw(t, len(t.output)) for t in self.running]
        found = []

        def pick(logits: torch.Tensor) -> torch.Tensor:
            tokens, logprobs = self.sampler.draw(logits, steps)
            found.append(logprobs)
            return tokens
        tokens = decode_tokens(self.model, batch, [t.output[-1] for t in self.running], pick,
                               self.forward)
        now = self.ledger.now()
        self.ledger.stage(self.running[0].req, "decode", start, now, resource="decoder",
                          batch=len(self.running), kv_tokens=kv_tokens)
        for row, (t, token) in enumerate(zip(list(self.running), tokens, strict=True)):
            t.output.append(token)
            top = t.request.sampling.logprobs
            if top is not None:
                chosen, alternatives = found[0][row]
                t.logprobs.append((chosen, alternatives[:top]))
            t.token_t.append(now)
            if self._complete(t):
                self._release(t)
            else:
                self.recovery.step(t)

    def _release(self, t: Tracked) -> None:
        self.ledger.release(t.req)
        self._leave_batch(t)
        self._finish(t, Status.OK)

    def _leave_batch(self, t: Tracked) -> None:
        """A running request ends: its K/V row and sampler slot are free."""
        self.running.remove(t)
        self.decode_cache.remove(t.seq)
        self.sampler.close(t.slot)
        t.seq, t.slot = None, 0

    def _finish(self, t: Tracked, status: Status, reason: str | None = None) -> None:
        t.status, t.reason, t.done_t = status, reason, self.ledger.now()
        self.done += 1
        if self.on_end is not None:
            self.on_end(t)
        self.last_progress = time.perf_counter()
        if self.progress is not None:
            self.progress.update(1)
