"""Every resource operation of a run, each one call with the event pdref checks.

Freeing or overwriting source pages (`reuse`), taking and returning decoder pages (`reserve`,
`release`, `abort`, `fence`), issuing copies (`issue`), publishing spans (`land`): the engine
does these only here, and each call emits its event first, so the live Monitor refuses an
illegal one before anything is freed, written or admitted (freeing source pages under a copy
in flight is COPY-3, live).
"""

from __future__ import annotations

import attrs
import torch

from pdgpu.copier import Copier, CopyJob, CopyResult
from pdgpu.decoder_pool import DecoderPool, Slab
from pdgpu.faults import Faults
from pdgpu.handoff import pieces
from pdgpu.recorder import Recorder
from pdgpu.source_cache import RequestKV, SourceCache
from pdgpu.workload import Request
from pdref import events as ev
from pdref.geometry import Geometry
from pdref.plan import Region


@attrs.frozen
class LifeKV:
    """One life of a request in `pdgpu run`: its source pages (and state slot) and decoder
    slab (and the decoder's state slot its state spans land in); the serve decoder's record
    of a life is another thing: serve/lives.py's Life."""

    request: Request
    src: RequestKV
    slab: Slab
    tokens: torch.Tensor  # [prompt] on the producer device
    state_slot: int | None = None  # the decoder state pool's slot (a hybrid's)

    @property
    def req(self) -> str:
        return self.request.req


class EngineLedger:
    """`pdgpu run`'s resource operations, each with its event checked by the Recorder (the
    serve decoder's door to its pool is serve/ledger.py's Ledger)."""

    def __init__(self, rec: Recorder, source: SourceCache, pool: DecoderPool, copier: Copier,
                 geometry: Geometry, faults: Faults) -> None:
        self.rec, self.source, self.pool, self.copier = rec, source, pool, copier
        self.geometry, self.faults = geometry, faults
        self._failed: set[str] = set()  # requests whose live life had a span fail
        copier.on_done = self.copy_done

    def failed(self, req: str) -> bool:
        """Whether a span of `req`'s live life failed: this ledger emitted its `fail` (the
        only event that marks a life failed), so no query of the Monitor's state is needed."""
        return req in self._failed

    def reserve(self, request: Request, src: RequestKV, tokens: torch.Tensor) -> LifeKV:
        """A decoder slab for the request's suffix: pdref's reserve picks the pages, this
        pool takes exactly those; (v3) the reserve names the producer's state slot `src`
        computes into, and the decoder takes a state slot for the spans to land in."""
        pages = self.rec.reserve(request.req, request.prompt, request.prefix, src.state_slot)
        self.pool.take(pages)
        with self.copier.decoder_side():
            slab = self.pool.slab(pages, request.prefix, request.prompt)
        slot = None if self.pool.states is None else self.pool.states.take()
        return LifeKV(request, src, slab, tokens, slot)

    def computed(self, req: str, layers, tokens) -> None:
        self.rec.emit(ev.Computed, req, layers, tokens)

    def issue(self, life: LifeKV, region: Region, ready) -> int:
        """`issue` the span (refused live: COPY-1, COPY-2 ...), then hand it to the copier."""
        span, r = self.rec.next_span(), life.request
        self.rec.emit(ev.Issue, life.req, span, region.layers, region.tokens,
                      region.span_bytes(self.geometry, r.prompt, r.prefix), region.state)
        parts = pieces(self.geometry, region, r.prompt, r.prefix,
                       (life.src.state_slot, life.state_slot))
        self.copier.submit(CopyJob(span, life.req, region.layers, region.tokens, life.src.slots,
                                   life.slab, ready, fail=self.faults.fails(span), pieces=parts))
        self.faults.after_issue(self, life)
        return span

    def copy_done(self, result: CopyResult) -> None:
        """On the copier's watcher, as soon as a span's last stage completed: its stages,
        then `land`, or `fail` and `fence`: every stage of it has completed, so its writer
        has stopped."""
        job = result.job
        for s in result.stages:
            self.rec.stage(job.req, s.name, s.start, s.end, job.span, s.resource)
        if result.error is None:
            self.land(job.req, job.span)
            self.faults.after_land(self, job.req, job.span)
            return
        self.rec.emit(ev.Fail, job.req, job.span, result.error)
        self._failed.add(job.req)
        self.fence(job.req, job.span)

    def fence(self, req: str, span: int) -> None:
        """The writer of a failed span has stopped: its slot and source tokens are free
        of it, and an aborted life's pages may return once no span of it is unfenced."""
        self.rec.emit(ev.Fence, req, span)

    def land(self, req: str, span: int) -> None:
        self.rec.emit(ev.Land, req, span)

    def free_source(self, life: LifeKV) -> None:
        """`reuse` every token of the request (refused live while a span reads one), then
        the source pages go back: the next request may overwrite them."""
        self.rec.emit(ev.Reuse, life.req, (0, life.request.prompt))
        self.source.close(life.src)

    def produced(self, req: str, token: int) -> None:
        self.rec.emit(ev.Produced, req, token)

    def admit(self, req: str) -> None:
        self.rec.emit(ev.Admit, req)

    def release(self, life: LifeKV) -> None:
        self.rec.emit(ev.Release, life.req)
        self.pool.follow(self.rec.free_page_ids())
        self._give_back_state(life)

    def _give_back_state(self, life: LifeKV) -> None:
        """The decoder's state slot of the life: no span writes it any more."""
        if life.state_slot is not None:
            self.pool.states.give_back(life.state_slot)

    def abort(self, life: LifeKV, reason: str) -> None:
        """Scrub the slab (a retry must rewrite every byte it relies on), `abort`, and give
        back the pages the specification has free again (all of them when every failed span
        was fenced; a quarantined page stays held until its writer's fence)."""
        unfenced = self.rec.unfenced(life.req)
        if unfenced:
            raise RuntimeError(f"abort of {life.req!r} with span {unfenced[0]} unfenced: the "
                               "engine aborts only once every writer has stopped")
        with self.copier.decoder_side():
            self.pool.scrub(life.slab)
            if life.state_slot is not None:
                self.pool.states.scrub(life.state_slot)
        self.rec.emit(ev.Abort, life.req, reason)
        self._failed.discard(life.req)
        self.pool.follow(self.rec.free_page_ids())
        self._give_back_state(life)
