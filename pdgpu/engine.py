"""The engine: prefill a request on the producer, hand its KV to the decoder, checked live.

Before t = 0 (unless `warmup` is off) the run warms up (engine_warmup.py). Per request (one at
a time, back to back on the same source pages), one loop over the step schedule of
`pdref.plan.plan_steps` (step_loop.py: compute, `computed`, issue, poll), then the head and
`produced` (whole mode issues its span here), wait for every span, `reuse` the source pages,
`admit`, `release`. On a failed span: `fail` and `fence` (from the watcher, once the span's
writer stopped), wait for the others, `reuse`, `abort`, retry.
Every resource operation goes through the EngineLedger (engine_ledger.py), which emits its
event first. Here: the run (buffers, header, metrics) and one life of a request.
"""

from __future__ import annotations

import time

import attrs
import torch

from pdgpu import audit, host
from pdgpu.copier import Copier, CopierConfig
from pdgpu.decoder_pool import DecoderPool
from pdgpu.engine_ledger import EngineLedger, LifeKV
from pdgpu.engine_warmup import WarmUp
from pdgpu.faults import DEBUG_BREAKS, Faults
from pdgpu.handoff import handoff_geometry, kv_geometry, kv_groups
from pdgpu.model import Transformer
from pdgpu.payload import payload_matches
from pdgpu.prefill import Prefill, warm_prefix
from pdgpu.recorder import Recorder, engine_metrics
from pdgpu.run_decode import RunDecoder
from pdgpu.source_cache import RequestKV, SourceCache
from pdgpu.step_loop import EngineError, Loop, StepLoop
from pdgpu.streams import compute_threads
from pdgpu.workload import EngineConfig, Plan, Request, setup_check
from pdref import events as ev

__all__ = ["DEBUG_BREAKS", "Engine", "EngineError", "Outcome", "RunResult"]


@attrs.frozen
class Outcome:
    req: str
    first_token: int | None  # None in export-only runs (nothing was computed)
    attempts: int
    kv: torch.Tensor | None  # decoder slab KV [L, 2, suffix, KVH, D] when keep_kv
    state: tuple | None = None  # a hybrid's landed state (StatePool.read's pair) when keep_kv
    tokens: tuple[int, ...] = ()  # output tokens (the first included), decoded from what crossed


@attrs.frozen
class RunResult:
    header: ev.Header
    events: tuple
    outcomes: tuple[Outcome, ...]
    metrics: dict



class Engine(WarmUp, StepLoop):
    """Serve requests one at a time through a producer, the copier and a decoder pool."""

    def __init__(self, model: Transformer, config: EngineConfig) -> None:
        self.model, self.config = model, config
        self.geometry = handoff_geometry(model.spec, config.page_tokens)  # the trace's (v3)
        self.kv_geometry = kv_geometry(self.geometry)  # the paged caches' (K/V layers only)
        self.faults = Faults(config.fail_span, config.debug)

    def run(self, requests: list[Request]) -> RunResult:
        """Serve the requests back to back; the trace and metrics of the whole run."""
        plan = setup_check(self.model.spec, self.config, requests)  # before any allocation
        host.keep_freed_memory()
        rec = Recorder(self._header(plan.pool_pages))
        try:
            self._allocate(plan, rec)
            outcomes, wall = self._serve_checked(rec, requests)
        except BaseException as e:  # the audit ends here; a violation it found is the cause
            cause = audit.cause(e, rec.stop())
            if cause is e:
                raise
            raise cause from e
        return RunResult(rec.header, tuple(rec.trace()), outcomes,
                         engine_metrics(rec, wall, self._extra_metrics()))

    def _serve_checked(self, rec: Recorder, requests: list[Request]):
        """Serve, stop the copier, surface its errors, then the end-of-run checks: the
        mirror's at once, then the audit's (the only wait for it)."""
        try:
            with compute_threads(self.config.device, self.config.threads):
                self.threads_used = torch.get_num_threads()
                self.warmup_s = self._warm_up(requests) if self.config.warmup else None
                self.ledger = EngineLedger(rec, self.source, self.pool, self.copier,
                                           self.geometry, self.faults)
                outcomes, wall = self._serve_all(rec, requests)
        finally:
            self.copier.close()
        self._raise_copy_errors()
        rec.close()
        return outcomes, wall

    def _allocate(self, plan: Plan, rec: Recorder) -> None:
        """Every buffer of the run, once: source cache, decoder pool, the copier's ring."""
        dtype, state = self.model.model.embed_tokens.weight.dtype, self.model.state_shape
        self.source = SourceCache(self.kv_geometry, plan.source_pages, self.config.device, dtype,
                                  state)
        self.pool = DecoderPool(self.kv_geometry, plan.pool_pages, self.config.decoder_device,
                                dtype, state)
        cfg = CopierConfig(plan.ring_slots, plan.span_elems, self.config.link_gbps)
        self.copier = Copier(cfg, self.source.kv, self.pool, rec.now,
                             source_states=self.source.states)
        self.decoder = RunDecoder(self.model, self.pool, self.config.page_tokens,
                                  self.config.chunk)

    def _header(self, pool_pages: int) -> ev.Header:
        c = self.config
        extra = {"chunk": c.chunk, "device": str(c.device), "decoder_device": str(c.decoder_device),
                 "model": self.model.spec.name, "engine": "pdgpu"}
        if c.link_gbps is not None:
            extra["link_gbps"] = c.link_gbps
        if c.no_compute:
            extra["no_compute"] = True
        return ev.Header("pdgpu", c.mode, self.geometry, pool_pages, c.max_pending,
                         extra=tuple(sorted(extra.items())))

    def _extra_metrics(self) -> dict:
        nothing_computed = {"first_token": None} if self.config.no_compute else {}
        return {**nothing_computed, "link_gbps": self.config.link_gbps,
                "device": str(self.config.device),
                "threads": self.threads_used, "warmup_s": self.warmup_s,
                "no_compute": self.config.no_compute,
                "staging_alloc_bytes": self.copier.staging_bytes,
                "host_staging_bytes": self.copier.host_staging_bytes,
                "source_alloc_bytes": self.copier.source_side_bytes}

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
        src = self.source.open(request.prompt, self._free_state_slot(rec))
        tokens = torch.tensor(request.tokens, dtype=torch.int64, device=self.config.device)
        prefill = self._warm_prefix(src, tokens, request.prefix)
        if first:
            rec.restart_clock()  # t = 0 once the producer's prefix cache is warm
        loop = Loop(self.ledger.reserve(request, src, tokens), prefill)
        self._run_steps(rec, loop)
        if self.ledger.failed(request.req):
            return self._abort(loop.life)
        token = self._first_token(rec, request.req, loop.prefill.last)
        self.ledger.produced(request.req, 0 if token is None else token)
        self.faults.after_produced(self.ledger, request.req)
        self._issue_ready(rec, loop)  # whole mode's span goes out here
        self._wait_all()
        if self.ledger.failed(request.req):
            return self._abort(loop.life)
        return self._admit(rec, loop.life, token, attempt)

    def _free_state_slot(self, rec: Recorder) -> int | None:
        """(v3) The producer's state slot of the next life: the one pdref names free (no
        live life holds it, no unfenced state span reads it); the source cache takes exactly
        that one, so the slot a `reserve` names is the slot the prefill writes."""
        return rec.ask("free_state_slot") if self.geometry.recurrent else None

    def _warm_prefix(self, src: RequestKV, tokens: torch.Tensor, prefix: int) -> Prefill:
        """The producer's prefix cache: K/V (and state) of [0, prefix) from an earlier
        request; the request's prefill, ready for its first step."""
        c = self.config
        last = warm_prefix(self.model, tokens, 0 if c.no_compute else prefix, c.chunk, src)
        self.copier.mark_ready().wait()  # done on the device before the timed part starts
        return Prefill(self.model, tokens, prefix, c.chunk, src, last)

    def _first_token(self, rec: Recorder, req: str, hidden):
        """Final norm and LM head on the last position's hidden state [1, E]: greedy token."""
        if self.config.no_compute:
            return None
        start = rec.now()
        token = int(self.model.logits(hidden).argmax(dim=-1)[0])
        rec.stage(req, "head", start, rec.now(), resource="producer")
        return token

    # -- end of a life -----------------------------------------------------------------------

    def _admit(self, rec: Recorder, life: LifeKV, token, attempt: int) -> Outcome:
        req = life.req
        self.ledger.free_source(life)
        if not rec.ask("can_admit", req):
            raise EngineError(f"request {req!r}: pdref refuses admission after every span landed")
        self.ledger.admit(req)
        if self.config.no_compute and not self._payload_landed(life):
            raise EngineError(f"request {req!r}: the decoder's KV is not the payload sent")
        kv = self.pool.read_slab(life.slab) if self.config.keep_kv else None
        state = self._landed_state(life) if self.config.keep_kv else None  # before the decode
        tokens = self._decode(life, token)  # (which advances the landed state in place)
        self.ledger.release(life)
        return Outcome(req, token, attempt, kv, state, tokens)

    def _payload_landed(self, life: LifeKV) -> bool:
        """Export only: the payload where the life's spans land it, and (linear layers) the
        zeros of its state, in the decoder."""
        r = life.request
        groups = kv_groups(self.geometry, (0, self.geometry.layers), (r.prefix, r.prompt),
                           r.prompt, r.prefix)
        return payload_matches(self.pool, life.slab, groups, life.state_slot)

    def _landed_state(self, life: LifeKV) -> tuple | None:
        """A copy of the state the life's state spans landed (None without linear layers)."""
        return None if life.state_slot is None else self.pool.states.read(life.state_slot)

    def _decode(self, life: LifeKV, first: int | None) -> tuple[int, ...]:
        """The output tokens decoded from what crossed (run_decode.py): the first alone
        unless more are asked; none in an export-only run."""
        count = self.config.output_tokens
        if first is None:
            return ()
        if count == 1:
            return (first,)
        r = life.request
        return self.decoder.tokens(r.tokens, r.prefix, life.slab, life.state_slot, first, count)

    def _abort(self, life: LifeKV) -> None:
        """A copy failed (and was fenced): let the others finish, free the source pages,
        abort; the decoder pages come back as pdref's pool frees them."""
        self._wait_all()
        self.ledger.free_source(life)
        self.ledger.abort(life, "copy failed")
        return None
