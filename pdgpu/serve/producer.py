"""A producer process: chunked prefill into its paged source cache, spans to the decoder.

Main thread: takes `prefill` jobs in order, computes chunk by chunk (layer by layer in layer
mode), reports `computed` and `produced`, and hands each span the mode sends to the sender
thread. Sender thread: waits for one of `max_pending` slots (a slot comes back with the
decoder's `ack`), announces `issue` (with this producer's span number `sid`), gathers the
region out of the source pages, holds it for the paced link, sends it with the digests taken
at compute time. A request's source pages go back in one of two ways, each bound to a
`reuse` event checked live by the decoder's ledger (COPY-3 across processes): on the
decoder's `reuse`, which it grants (its event emitted and accepted first) once every span
reading them was acknowledged; or on this producer's own initiative (`give_back`), which
first sends its own `reuse` (the tokens given back), checked when the decoder reads it,
before any later message of this producer: a give-back while a span still reads those
tokens is COPY-3, a span issued from them afterwards COPY-1, the run stops naming this
producer. No other code frees a life's source pages.
A `cancel` stops a life: no more compute, no span of it starts, a stalled one is released;
the sender says `stopped` between two spans (never between a span's issue and its bytes,
and before any later span of the life, which it then drops unissued), so the decoder knows
nothing more of that life can arrive. Every issued span keeps its slot until the decoder
acknowledges it: its bytes arrived, or (a span dropped after its issue) the life stopped.
The sender thread is span_sender.py; injected faults are asked there. A hand-made bug
(`--debug`, bugs.py) is one object given at construction and called at fixed hooks; the
default, `NO_BUG`, changes nothing, so no debug switch lives in the compute or copy path.
A heartbeat thread sends `beat` every `beat_s` seconds.
A hybrid (contract v3, pdgpu/handoff.py): spans name model layers, the source pages hold the
K/V layers only; a sliding layer's rows cross for its window only; each life computes its
linear layers' state into the state slot the decoder's `reserve` named (zeroed, or the
prefix's snapshot), and once they have the whole prompt a state span per run of linear
layers carries it, digested then (`--verify`), gathered by the sender like K/V.
With `--prefix-cache` (producer_cache.py) a life skips the whole chunks its producer's cache
holds, and the pages it computed enter that cache; it lets go of them at the decoder's
`reuse`, like its own pages. A `prefill` waits (`Queued`) with its prompt's key chain,
hashed once however many turns it waits for room.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import attrs
import torch

from pdgpu.generate import first_token
from pdgpu.handoff import handoff_geometry, kv_geometry
from pdgpu.prefill import Prefill, warm_prefix
from pdgpu.prefix_index import KeyChain
from pdgpu.sampler import Sampler, Step
from pdgpu.sampling import GREEDY, Sampling
from pdgpu.serve.bugs import NO_BUG, NoBug
from pdgpu.serve.config import ServeConfig
from pdgpu.serve.digest import DigestingKV, row_digests, state_rows
from pdgpu.serve.producer_cache import ProducerCache, plan_life, plan_with_hit
from pdgpu.serve.span_sender import SpanSender
from pdgpu.serve.transport import Transport
from pdgpu.source_cache import SourceCache, token_slots
from pdgpu.source_prefix import Held
from pdgpu.state_pool import StatePool
from pdref.events import Mode
from pdref.plan import Region

DECODER = 0


@attrs.frozen
class Queued:
    """A `prefill` waiting for room: its message and (with the prefix cache) its prompt's
    key chain, kept so that each turn's look-up hashes nothing again."""

    body: dict
    keys: KeyChain | None = None


@attrs.define
class Job:
    """One life of one request on this producer."""

    handle: str
    tokens: torch.Tensor  # [prompt]
    prefix: int
    pages: tuple[int, ...]  # this life's own source pages (the prefix pages are shared)
    kv: DigestingKV
    steps: list  # chunk ranges (chunk-major) or layer ids (layer mode) still to compute
    ready: list  # per step still to compute: the spans ready once it is (chunk, layer mode)
    prefill: Prefill  # the compute, step by step, into `kv` (its `last` hidden state)
    start: int  # the first token computed (the prefix, or the end of a cache hit)
    after: list  # the spans queued after `produced` (whole mode, an empty suffix)
    held: Held | None = None  # what it holds in the prefix cache (--prefix-cache)
    keys: KeyChain | None = None  # its prompt's key chain (--prefix-cache)
    req: str = ""  # the request's id (an `evict` names whom its room is for)
    draw: Step = Step(GREEDY, 0)  # how the first token is drawn (the request's options)
    cancelled: bool = False
    stop: threading.Event = attrs.Factory(threading.Event)  # set by the life's cancel
    state_sums: dict = attrs.Factory(dict)  # state span's layers -> its digests (conv, rec)

    @property
    def prompt(self) -> int:
        return self.tokens.shape[0]


class Producer:
    def __init__(self, transport: Transport, config: ServeConfig, model, name: str,
                 bugs: NoBug = NO_BUG, generation: int = 0) -> None:
        self.transport, self.config, self.model, self.name = transport, config, model, name
        self.bugs = bugs  # a hand-made bug's hooks (bugs.py); NO_BUG: none
        self.geometry = handoff_geometry(model.spec, config.page_tokens)  # what spans name
        self.device = model.inv_freq.device
        dtype = model.model.embed_tokens.weight.dtype
        self.cache = SourceCache(kv_geometry(self.geometry), config.source_pages, self.device,
                                 dtype, model.state_shape)
        self.cache.pool, self.prefix_pages = self.cache.pool.allocate(
            self.geometry.pages_for(config.prefix))
        self.prefix_state = None  # a hybrid's state after the prefix (StatePool.read's pair)
        self.prefix_last = self._warm_prefix()
        self.prefix_cache = None if not config.prefix_cache_pages else ProducerCache(
            self.cache, self.geometry.layers, config.prefix_cache_pages, config.chunk,
            generation * config.source_pages, self._send)  # ids unique across restarts
        self.sampler = Sampler(model.spec.vocab, self.device)  # the first tokens' draws
        self.waiting: deque[Queued] = deque()
        self.active: Job | None = None
        self.jobs: dict[str, Job] = {}
        self.clock0 = time.perf_counter()
        self.sender = SpanSender(self)  # its thread: spans out, `stopped` between them
        self.sids, self.outbox = self.sender.sids, self.sender.outbox  # (the bugs' hooks)
        self.closing = threading.Event()
        self.beater = threading.Thread(target=self._beat_loop, daemon=True, name="pdgpu-beat")
        self.beater.start()

    def now(self) -> float:
        return time.perf_counter() - self.clock0

    # -- setup --------------------------------------------------------------------------------

    def _warm_prefix(self) -> torch.Tensor | None:
        """The prefix cache: K/V of the shared prefix, computed once, never freed; the last
        prefix position's hidden state [1, E] (None without a prefix)."""
        prefix = self.config.prefix
        if not prefix:
            return None
        slots = token_slots(self.prefix_pages, self.geometry.page_tokens, prefix, self.device)
        kv = self.cache.view(slots, self.prefix_pages)
        shape = self.model.state_shape
        if shape is not None:  # the prefix's state, computed in a pool of its own
            kv = attrs.evolve(kv, state_pool=StatePool(shape, 1, self.device), state_slot=0)
        ids = torch.tensor(self.config.prefix_tokens, dtype=torch.int64, device=self.device)
        last = warm_prefix(self.model, ids, prefix, self.config.chunk, kv)
        self.prefix_state = kv.read_state()
        return last

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until the decoder says `shutdown`."""
        while True:
            if self.sender.error is not None:
                raise self.sender.error
            msg = self.transport.get(timeout=0 if self._busy() else 0.05)
            if msg is not None:
                if msg.op == "shutdown":
                    return
                if msg.op == "lost":
                    raise RuntimeError(f"producer {self.name}: {msg.body['error']}")
                self._handle(msg)
                continue
            self._step()

    def _busy(self) -> bool:
        return self.active is not None or self._can_start()

    def _handle(self, msg) -> None:
        body = msg.body
        if msg.op == "prefill":
            keys = None if self.prefix_cache is None else self.prefix_cache.chain(body["tokens"])
            self.waiting.append(Queued(body, keys))
        elif msg.op == "ack":
            for _ in range(body.get("slots", 1)):
                self.sender.slots.release()
        elif msg.op == "reuse":
            self._free(body["handle"])
        elif msg.op == "cached":  # the decoder's word on a `cache` of ours
            job = self.jobs.get(body["handle"])
            if job is not None and job.held is not None:
                self.prefix_cache.confirm(job.held, body["recorded"])
        elif msg.op == "cancel":
            self._cancel(body["handle"])
        elif msg.op == "clock":  # the decoder relates our clock to its own (clock.py)
            self._send("clock", now=self.now())
        else:
            raise RuntimeError(f"producer {self.name}: unknown message {msg.op!r}")

    def _can_start(self) -> bool:
        if not self.waiting:
            return False
        head = self.waiting[0]
        if self.prefix_cache is not None:
            return self.prefix_cache.can_open(head.keys)
        need = self.geometry.pages_for(len(head.body["tokens"])) - len(self.prefix_pages)
        return need <= self.cache.pool.free_pages

    def _step(self) -> None:
        if self.active is None and self._can_start():
            self.active = self._open(self.waiting.popleft())
        if self.active is None:
            self._flush_deferred()
            return
        job = self.active
        if job.steps:
            self._compute(job)
            self._flush_deferred()  # a copy held back (debug early-reuse) starts here
        else:
            self._produce(job)
            self.active = None

    # -- one job ------------------------------------------------------------------------------

    def _open(self, queued: Queued) -> Job:
        body = queued.body
        tokens = torch.tensor(body["tokens"], dtype=torch.int64, device=self.device)
        prompt = tokens.shape[0]
        prefix = body.get("prefix", self.config.prefix)  # the decoder's: not sent
        held, last = None, self.prefix_last
        if self.prefix_cache is None:
            self.cache.pool, own = self.cache.pool.allocate(
                self.geometry.pages_for(prompt) - len(self.prefix_pages))
            pages, start = self.prefix_pages + own, prefix
        else:  # its hit is not computed (and [prefix, hit) crosses from the hit's pages)
            held = self.prefix_cache.open(body.get("req", body["handle"]), body["handle"],
                                          queued.keys)
            own, pages, start, last = (), held.pages, held.skip, None
        slots = token_slots(pages, self.geometry.page_tokens, prompt, self.device)
        kv = DigestingKV(self.cache.view(slots, pages, self._state_slot(body)),
                         self.cache.geometry.layers, prompt, self.device)
        if held is not None:
            self.prefix_cache.load(kv, held)
        plan = (plan_life if held is None else plan_with_hit)(
            self.config.mode, self.geometry, prompt, start, prefix, self.config.chunk)
        draw = Step(Sampling(**body.get("sampling", {})), 0, tuple(body.get("ban", ())))
        prefill = Prefill(self.model, tokens, start, self.config.chunk, kv, last)
        job = Job(body["handle"], tokens, prefix, own, kv, plan.steps, plan.ready, prefill,
                  start, plan.after, held, queued.keys, body.get("req", body["handle"]),
                  draw=draw)
        self.jobs[job.handle] = job
        for region in plan.upfront:  # spans over the hit: its pages hold every layer
            self._queue_span(job, region)
        return job

    def _state_slot(self, body: dict) -> int | None:
        """The life's state slot (a hybrid's: the one its reserve named), made ready: the
        prefix's state, or zeros."""
        slot = body.get("state_slot")
        if slot is not None:
            self.cache.states.claim(slot)
            if self.prefix_state is not None:
                self.cache.states.write(slot, *self.prefix_state)
        return slot

    def _compute(self, job: Job) -> None:
        start = self.now()
        step = job.steps.pop(0)
        self.bugs.before_compute(self, job, step)
        if self.config.mode is Mode.LAYER:
            job.prefill.layer(step)
            layers, tokens = (step, step + 1), (job.start, job.prompt)
        else:
            job.prefill.chunk(step)
            layers, tokens = (0, self.geometry.layers), step
            if job.held is not None:
                self.prefix_cache.computed(job.held, job.kv, step[1])
        self._send("computed", handle=job.handle, layers=layers, tokens=tokens,
                   start=start, end=self.now())
        spans = job.ready.pop(0)
        if self.config.mode is not Mode.WHOLE:  # (whole mode: its spans after `produced`)
            for region in spans:
                self._queue_span(job, region)

    def _produce(self, job: Job) -> None:
        start = self.now()
        slot = self.sampler.open(job.draw.sampling, job.tokens)
        found = []

        def pick(logits: torch.Tensor) -> torch.Tensor:
            tokens, logprobs = self.sampler.draw(logits, [job.draw._replace(slot=slot)])
            found.extend(logprobs or ())
            return tokens
        token = first_token(self.model, job.prefill.last, pick)
        self.sampler.close(slot)
        if job.held is not None:  # its new whole pages into the cache, before `produced`
            self.prefix_cache.keep(job.req, job.handle, job.keys, job.held, job.prefix)
        asked = {"logprob": found[0]} if found else {}
        self._send("produced", handle=job.handle, token=token, start=start, end=self.now(),
                   **asked)
        for region in job.after:  # (an empty suffix: still a hybrid's states cross)
            self._queue_span(job, region)
        self.bugs.after_produced(self, job)

    def _queue_span(self, job: Job, region: Region) -> None:
        if region.state:  # its digests now: the state is final once its layers computed
            conv, recurrent = self.sender.state_of(job, region)
            job.state_sums[region.layers] = (row_digests(state_rows(conv)),
                                             row_digests(state_rows(recurrent)))
        self.bugs.queue(self.outbox, (job, region))

    def _flush_deferred(self) -> None:
        self.bugs.flush(self.outbox)

    def _cancel(self, handle: str) -> None:
        """Stop a life: no more compute or spans; `stopped` once the sender passed it."""
        job = self.jobs.get(handle)
        if job is not None:
            job.cancelled = True
            job.stop.set()
            job.steps = []
            if self.active is job:
                self.active = None
        self.waiting = deque(q for q in self.waiting if q.body["handle"] != handle)
        self._flush_deferred()
        self.sender.stopping.append(handle)

    def _free(self, handle: str) -> None:
        """The decoder granted `reuse` (its event already checked): the pages go back."""
        job = self.jobs.pop(handle, None)  # None: cancelled before it was opened
        if job is None:
            return
        self._release_pages(job)

    def give_back(self, job: Job) -> None:
        """Give the life's own source pages back before the decoder granted it: announced
        first as this producer's `reuse` of the life's tokens, which the decoder's ledger
        checks (nothing in this codebase does it; a hand-made bug, bugs.EarlyReuse, does)."""
        self._send("reuse", handle=job.handle, tokens=[job.prefix, job.prompt])
        self._release_pages(job)

    def _release_pages(self, job: Job) -> None:
        if job.held is not None:  # lets go of its cached pages; the rest go back
            self.prefix_cache.release(job.held)
            job.held = None
        self.cache.pool = self.cache.pool.give_back(job.pages)
        job.pages = ()

    def _send(self, op: str, tensors=(), **body) -> None:
        self.transport.send(DECODER, op, body, tensors)

    def _beat_loop(self) -> None:
        try:
            while not self.closing.wait(self.config.beat_s):
                self._send("beat")
        except Exception:  # noqa: BLE001 - the decoder is gone: the main loop hears `lost`
            return

    def close(self) -> None:
        self.closing.set()
        self.sender.close()
