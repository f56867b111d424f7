"""The engine: prefill a request on the producer, hand its KV to the decoder, checked live.

Before t = 0 (unless `warmup` is off): one throwaway chunk of prefill and the head, and one
copy through every staging slot into the decoder pool, on the run's devices and threads; then
the source pages go back and both caches are zeroed. Nothing of it is traced or checked.

Per request (one at a time, back to back on the same source pages):
  schedule  reserve a decoder slab through pdref, plan chunks and spans (pdref.plan)
  run       compute chunk by chunk (layer by layer in layer mode), emit `computed`, issue
            each span the mode sends as soon as pdref's `can_issue` allows (blocking while
            max_pending are in flight), harvest landed spans between steps
  finish    `produced`, drain, `reuse` the source pages, `admit` when pdref's `can_admit`
            says so, `release`; on a failed span: drain, `abort`, return pages, retry.
Every protocol event goes through the Recorder's Monitor as it happens.
"""

from __future__ import annotations

import time

import attrs
import torch

from pdgpu import host
from pdgpu.copier import Copier, CopierConfig, CopyJob, CopyResult, compute_threads
from pdgpu.decoder_pool import DecoderPool, Slab
from pdgpu.model import Transformer
from pdgpu.recorder import Recorder, engine_metrics
from pdgpu.source_cache import RequestKV, SourceCache
from pdgpu.workload import DEBUG_BREAKS, EngineConfig, Plan, Request, setup_check
from pdref import events as ev
from pdref.events import Mode
from pdref.plan import Region, plan_chunks, plan_spans

__all__ = ["DEBUG_BREAKS", "Engine", "EngineError", "Outcome", "RunResult"]

class EngineError(RuntimeError):
    """A run that cannot go on (every retry failed, admission refused)."""


@attrs.frozen
class Outcome:
    req: str
    first_token: int
    attempts: int
    kv: torch.Tensor | None  # decoder slab KV [L, 2, suffix, KVH, D] when keep_kv


@attrs.frozen
class Attempt:
    """One life of a request: its source pages and decoder slab."""

    request: Request
    src: RequestKV
    slab: Slab
    tokens: torch.Tensor  # [prompt] on the producer device


@attrs.frozen
class RunResult:
    header: ev.Header
    events: tuple
    outcomes: tuple[Outcome, ...]
    metrics: dict


class Engine:
    def __init__(self, model: Transformer, config: EngineConfig) -> None:
        self.model, self.config = model, config
        self.geometry = model.spec.geometry(config.page_tokens)

    def run(self, requests: list[Request]) -> RunResult:
        """Serve the requests back to back; the trace and metrics of the whole run."""
        plan = setup_check(self.model.spec, self.config, requests)  # before any allocation
        host.keep_freed_memory()
        rec = Recorder(self._header(plan.pool_pages))
        self._allocate(plan, rec)
        try:
            with compute_threads(self.config.device, self.config.threads):
                self.threads_used = torch.get_num_threads()
                self.warmup_s = self._warm_up(requests) if self.config.warmup else None
                outcomes, wall = self._serve_all(rec, requests)
        finally:
            self.copier.close()
        rec.monitor.close()
        return RunResult(rec.header, tuple(rec.trace()), outcomes,
                         engine_metrics(rec, wall, self._extra_metrics()))

    def _allocate(self, plan: Plan, rec: Recorder) -> None:
        """Every buffer of the run, once: source cache, decoder pool, the copier's ring."""
        dtype = self.model.model.embed_tokens.weight.dtype
        self.source = SourceCache(self.geometry, plan.source_pages, self.config.device, dtype)
        self.pool = DecoderPool(self.geometry, plan.pool_pages, self.config.decoder_device, dtype)
        cfg = CopierConfig(plan.ring_slots, plan.span_elems, self.config.link_gbps)
        self.copier = Copier(cfg, self.source.kv, self.pool, rec.now)

    def _header(self, pool_pages: int) -> ev.Header:
        c = self.config
        extra = {"chunk": c.chunk, "device": str(c.device), "decoder_device": str(c.decoder_device),
                 "model": self.model.spec.name, "engine": "pdgpu"}
        if c.link_gbps is not None:
            extra["link_gbps"] = c.link_gbps
        return ev.Header("pdgpu", c.mode, self.geometry, pool_pages, c.max_pending,
                         extra=tuple(sorted(extra.items())))

    def _extra_metrics(self) -> dict:
        return {"link_gbps": self.config.link_gbps, "device": str(self.config.device),
                "threads": self.threads_used, "warmup_s": self.warmup_s,
                "staging_alloc_bytes": self.copier.staging_bytes,
                "host_staging_bytes": self.copier.host_staging_bytes,
                "source_alloc_bytes": self.copier.source_side_bytes}

    def _warm_up(self, requests: list[Request]) -> float:
        """Before t = 0: prefill one chunk (and the head) of the request with the largest
        span into its source pages, copy that span once through every staging slot into the
        decoder pool, give the pages back and zero both caches. Seconds it took."""
        start = time.perf_counter()
        request = max(requests, key=self._largest_region_elems)
        src = self.source.open(request.prompt)
        tokens = torch.tensor(request.tokens[:self.config.chunk], dtype=torch.int64,
                              device=self.config.device)
        if len(tokens):
            hidden = self.model.prefill_chunk(tokens, 0, src)[-1:]  # [1, E]
            self.model.logits(hidden)
        ready = self.copier.mark_ready()
        region = max(self._plan_spans(request), key=self._region_elems, default=None)
        if region is not None:
            pages = tuple(range(self.geometry.pages_for(request.prompt - request.prefix)))
            slab = self.pool.slab(pages, request.prefix, request.prompt)
            self.copier.warm_up([CopyJob(-1 - i, "warm-up", region.layers, region.tokens,
                                         src.slots, slab, ready)
                                 for i in range(self.copier.config.slots)])
        self.source.close(src)
        self.source.kv.zero_()  # on the compute stream, before the first request's prefill
        self.copier.mark_ready()
        return time.perf_counter() - start

    def _region_elems(self, region: Region) -> int:
        return region.bytes(self.geometry) // self.geometry.dtype_bytes

    def _largest_region_elems(self, request: Request) -> int:
        return max(map(self._region_elems, self._plan_spans(request)), default=0)

    def _plan_spans(self, request: Request) -> list[Region]:
        return plan_spans(self.config.mode, self.geometry, request.prompt, request.prefix,
                          self.config.chunk)

    def _serve_all(self, rec: Recorder, requests: list[Request]):
        outcomes = tuple(self._serve(rec, r, first=i == 0) for i, r in enumerate(requests))
        return outcomes, time.perf_counter() - rec.t0

    def _serve(self, rec: Recorder, request: Request, first: bool) -> Outcome:
        for attempt in range(1, self.config.retries + 2):
            outcome = self._attempt(rec, request, attempt, first and attempt == 1)
            if outcome is not None:
                return outcome
        raise EngineError(f"request {request.req!r}: copy failed on all {attempt} attempts")

    # -- one life of a request ---------------------------------------------------------------

    def _attempt(self, rec: Recorder, request: Request, attempt: int, first: bool):
        src = self.source.open(request.prompt)
        tokens = torch.tensor(request.tokens, dtype=torch.int64, device=self.config.device)
        warm = self._warm_prefix(src, tokens, request.prefix)  # [1, E] or None
        if first:
            rec.restart_clock()  # t = 0 once the producer's prefix cache is warm
        pages = rec.reserve(request.req, request.prompt, request.prefix)
        att = Attempt(request, src, self.pool.slab(pages, request.prefix, request.prompt), tokens)
        last = self._compute(rec, att)
        hidden = warm if last is None else last  # [1, E]
        if rec.failed(request.req):
            return self._abort(rec, att)
        return self._finish(rec, att, self._first_token(rec, request.req, hidden), attempt)

    def _first_token(self, rec: Recorder, req: str, hidden: torch.Tensor) -> int:
        """Final norm and LM head on the last position's hidden state [1, E]: greedy token."""
        start = rec.now()
        token = int(self.model.logits(hidden).argmax(dim=-1)[0])
        rec.stage(req, "head", start, rec.now(), resource="producer")
        return token

    def _warm_prefix(self, src: RequestKV, tokens: torch.Tensor, prefix: int):
        """The producer's prefix cache: K/V of [0, prefix) from an earlier request."""
        hidden = None
        for a, b in plan_chunks(prefix, 0, self.config.chunk):
            hidden = self.model.prefill_chunk(tokens[a:b], a, src)[-1:]  # [1, E]
        self.copier.mark_ready()  # done on the device too before the timed part starts
        return hidden

    def _compute(self, rec: Recorder, att: Attempt):
        if self.config.mode is Mode.LAYER:
            return self._compute_layers(rec, att)
        return self._compute_chunks(rec, att)

    def _spans(self, att: Attempt) -> list[Region]:
        return self._plan_spans(att.request)

    def _compute_chunks(self, rec: Recorder, att: Attempt):
        """Chunk-major prefill; in chunk mode each chunk's span goes out as it is done."""
        r, hidden = att.request, None
        spans = self._spans(att) if self.config.mode is Mode.CHUNK else []
        for i, (a, b) in enumerate(plan_chunks(r.prompt, r.prefix, self.config.chunk)):
            if rec.failed(r.req):
                return None
            if spans and self.config.debug == "issue-early":
                self._issue(rec, att, spans[i], self.copier.mark_ready())
            start = rec.now()
            hidden = self.model.prefill_chunk(att.tokens[a:b], a, att.src)[-1:]  # [1, E]
            ready = self._computed(rec, att, (0, self.geometry.layers), (a, b), start)
            if spans and self.config.debug != "issue-early":
                self._issue(rec, att, spans[i], ready)
        return hidden

    def _compute_layers(self, rec: Recorder, att: Attempt):
        """Layer-major prefill: each layer over the whole suffix, then its span goes out."""
        r = att.request
        chunks = plan_chunks(r.prompt, r.prefix, self.config.chunk)
        hs = [self.model.embed(att.tokens[a:b]) for a, b in chunks]  # [n_i, E] each
        for layer, span in enumerate(self._spans(att)):
            if rec.failed(r.req):
                return None
            start = rec.now()
            hs = [self.model.run_layer(layer, h, a, att.src)
                  for h, (a, _) in zip(hs, chunks, strict=True)]  # [n_i, E] each
            ready = self._computed(rec, att, (layer, layer + 1), (r.prefix, r.prompt), start)
            self._issue(rec, att, span, ready)
        return hs[-1][-1:] if hs else None

    def _computed(self, rec: Recorder, att: Attempt, layers, tokens, start: float):
        """Close a compute step: readiness marker, `stage compute`, `computed`, harvest."""
        ready = self.copier.mark_ready()
        rec.stage(att.request.req, "compute", start, rec.now(), resource="producer")
        rec.emit(ev.Computed, att.request.req, layers, tokens)
        self._harvest(rec, self.copier.poll())
        return ready

    # -- copies ------------------------------------------------------------------------------

    def _issue(self, rec: Recorder, att: Attempt, region: Region, ready) -> None:
        """Issue one span once pdref allows it: the producer blocks while max_pending fly."""
        req = att.request.req
        self._wait_for_slot(rec, req)
        if rec.failed(req):
            return
        span = rec.next_span()
        rec.emit(ev.Issue, req, span, region.layers, region.tokens, region.bytes(self.geometry))
        self.copier.submit(CopyJob(span, req, region.layers, region.tokens, att.src.slots,
                                   att.slab, ready, fail=span == self.config.fail_span))
        if self.config.debug == "early-reuse":
            rec.emit(ev.Reuse, req, (0, att.request.prompt))

    def _wait_for_slot(self, rec: Recorder, req: str) -> None:
        if self.config.debug == "skip-block":
            return
        start, waited = rec.now(), False
        while not rec.ask("can_issue") and not rec.failed(req):
            self._harvest(rec, [self.copier.wait()])
            waited = True
        if waited:
            rec.stage(req, "blocked", start, rec.now(), resource="producer")

    def _harvest(self, rec: Recorder, results: list[CopyResult]) -> None:
        """Publish finished copies: their stages, then `land` or `fail`."""
        for result in results:
            job = result.job
            for s in result.stages:
                rec.stage(job.req, s.name, s.start, s.end, job.span, s.resource)
            if result.error is not None:
                rec.emit(ev.Fail, job.req, job.span, result.error)
                continue
            rec.emit(ev.Land, job.req, job.span)
            if self.config.debug == "double-land":
                rec.emit(ev.Land, job.req, job.span)

    # -- end of a life -----------------------------------------------------------------------

    def _finish(self, rec: Recorder, att: Attempt, token: int, attempt: int):
        req = att.request.req
        rec.emit(ev.Produced, req, token)
        if self.config.mode is Mode.WHOLE:
            for region in self._spans(att):
                self._issue(rec, att, region, self.copier.mark_ready())
        if self.config.debug == "admit-early":
            rec.emit(ev.Admit, req)
        self._harvest(rec, self.copier.drain())
        if rec.failed(req):
            return self._abort(rec, att)
        return self._admit(rec, att, token, attempt)

    def _admit(self, rec: Recorder, att: Attempt, token: int, attempt: int) -> Outcome:
        req = att.request.req
        rec.emit(ev.Reuse, req, (0, att.request.prompt))
        self.source.close(att.src)
        if not rec.ask("can_admit", req):
            raise EngineError(f"request {req!r}: pdref refuses admission after every span landed")
        rec.emit(ev.Admit, req)
        kv = self.pool.read_slab(att.slab) if self.config.keep_kv else None
        rec.emit(ev.Release, req)
        return Outcome(req, token, attempt, kv)

    def _abort(self, rec: Recorder, att: Attempt) -> None:
        """A copy failed: let every copy in flight finish, abort, return all pages."""
        self._harvest(rec, self.copier.drain())
        rec.emit(ev.Abort, att.request.req, "copy failed")
        self.source.close(att.src)
        self.pool.scrub(att.slab)  # the retry must rewrite every byte it relies on
        return None
