"""The decoder's protocol authority: every resource operation of the handoff pool is one call
with its pdref event, and is refused (raises Violation, nothing done) when the live check
refuses it. It decides and records; the bytes are moved and checked by its KV landing
(`kv_landing`, landing.py), which it tells what to do only once pdref has agreed.

reserve -> pages of a slab (and, for a model with linear layers, the producer's state slot
pdref names free; the landing opens the slab's token slots and a state landing slot) |
issue -> a span id | land -> pdref says where the span lands, the landing writes and checks
its bytes (`--verify`), then `land` or `fail` | reuse -> the producer may free its source
pages | admit -> where the request's context lies (the landing names its slots and its
landed state's slot; the decode cache gathers it once) | release / abort -> pages and slots
back. pdref is the authority
for every process of the run. Every accepted event goes to the run's TraceLog (written while
the run goes).

Live checks off the critical path (as pdgpu/recorder.py does for the engine): pdref's
`FastMonitor` (the mutable mirror) gives every verdict and answers every query the decoder
decides with, in line; every accepted event and every such answer also goes to the audit
thread (pdgpu/audit.py), which replays them into the specification's `Monitor`. What it
refuses, or answers differently, is raised at the decoder's next call into the ledger or
at the next turn of its loop (`raise_audit_error`), at most `audit.BOUND` events later
(backpressure), and at the end of the run, which waits for the audit (`close`). The
decoder never reads pdref's state (on the mirror that copies all of it): the query
`landing` tells whether a span may land, and where, before its bytes are written.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from pdgpu.audit import BOUND, Disagreement
from pdgpu.live_check import LiveCheck
from pdgpu.serve.landing import Context, KVLanding
from pdgpu.serve.tracelog import TraceLog
from pdgpu.state_pool import StateShape
from pdref import events as ev
from pdref.apply import apply
from pdref.monitor import Monitor
from pdref.violations import Violation


class Ledger:
    """The live check (`live`, pdgpu/live_check.py) with no lock (the decoder's loop is one
    thread) and the trace as its sink: an accepted event is written to the TraceLog after
    the check returns, outside the check's time (writing the trace is not a check)."""

    def __init__(self, header: ev.Header, device, dtype: torch.dtype,
                 log: TraceLog | None = None, audit_monitor=Monitor,
                 audit_bound: int = BOUND, state: StateShape | None = None,
                 prefix_kv: torch.Tensor | None = None) -> None:
        self.header = header
        self.geometry = header.geometry
        self.log = log if log is not None else TraceLog(header, None)
        self.recent: deque = deque(maxlen=8)  # the last protocol events (for tests, errors)
        self._accepted: list = []  # accepted by the mirror, not yet in the trace
        self.kv_landing = KVLanding(self.geometry, header.pool_pages, device, dtype, state,
                                    prefix_kv)
        self.live = LiveCheck(header, self._accepted.append, audit_monitor=audit_monitor,
                              audit_bound=audit_bound)
        self.peak_pages = 0
        self.slabs: dict[str, tuple[int, ...]] = {}  # req -> its live life's slab pages
        self.on_end = None  # called with a req whose life ended (released or aborted)
        self._spans = itertools.count()
        self.t0 = time.perf_counter()

    def restart_clock(self) -> None:
        if self.live.monitor.events:
            raise RuntimeError("the clock can only restart before the first event")
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def trace_time(self, absolute: float) -> float:
        """A perf_counter reading of this process as trace time (never before 0)."""
        return max(0.0, absolute - self.t0)

    def _check(self, name: str, *args, audited: bool = False):
        """The live check's `ask`; what the mirror accepted meanwhile, into the trace."""
        try:
            return self.live.ask(name, *args, audited=audited)
        finally:
            if self._accepted:
                self._write_accepted()

    def _write_accepted(self) -> None:
        """The event the mirror just accepted, into the trace (outside the check's time)."""
        now = self.now()
        for event in self._accepted:
            self.recent.append(event)
            self.log.add(event, now)
        self._accepted.clear()

    def _emit(self, cls, *fields):
        self._check("emit", cls(self.now(), *fields))

    def raise_audit_error(self) -> None:
        """What the audit found so far, raised: the decoder's loop asks at every turn, so a
        run that makes no call into the ledger for a while (idle, decoding) stops too."""
        self.live.raise_found()

    def write_trace(self) -> None:
        """The trace written up to its window (the loop's every turn: an idle server's last
        events reach the file too)."""
        self.log.release(self.now())

    # -- queries ------------------------------------------------------------------------------

    def can_reserve(self, prompt: int, prefix: int) -> bool:
        return self._check("can_reserve", prompt, prefix, audited=True)

    def can_admit(self, req: str) -> bool:
        return self._check("can_admit", req, audited=True)

    def free_pages(self) -> int:
        """Pages of the pool no slab, quarantine or cache holds."""
        return len(self._check("free_page_ids", audited=True))

    def unfenced(self, req: str) -> tuple:
        """Span ids of `req` whose writer has not been fenced yet."""
        return self._check("unfenced", req, audited=True)

    @property
    def used_pages(self) -> int:  # a metric (the peak), not a decision: not audited
        return self.header.pool_pages - self.live.monitor.free_pages

    @property
    def leaked_pages(self) -> int:
        """Pages not in pdref's free pool (held by a slab or quarantined)."""
        return self.header.pool_pages - len(self.live.monitor.free_page_ids())

    # -- operations ---------------------------------------------------------------------------

    def reserve(self, req: str, prompt: int, prefix: int, producer: str,
                hit: tuple[int, ...] | None = None) -> int | None:
        """Reserve a slab (its pages: `slabs`); the producer's state slot the life computes
        into (a model with linear layers: the lowest that pdref has free for `producer`), or
        None. `hit` (v4): the decoder's cached pages that hold [0, prefix)."""
        slot = None
        if self.kv_landing.keeps_state:
            slot = self._check("free_state_slot", producer, audited=True)
        pages = self._check("reserve", self.now(), req, prompt, prefix, producer, slot, hit)
        self.slabs[req] = pages
        self.kv_landing.open(req, pages, prompt, prefix, hit or ())
        self.peak_pages = max(self.peak_pages, self.used_pages)
        return slot

    def computed(self, req: str, layers, tokens, hit=None) -> None:
        """(v4) `hit`: the producer's cached pages the region is in (nothing computed)."""
        self._emit(ev.Computed, req, tuple(layers), tuple(tokens), hit)

    def cache(self, req: str, tokens, pages, producer: str | None = None) -> None:
        """(v4) Whole pages enter a prefix cache: the decoder's, or `producer`'s."""
        self._emit(ev.Cache, req, tuple(tokens), tuple(pages), producer)

    def evict(self, req: str, pages, producer: str | None = None) -> None:
        """(v4) Cached pages nobody holds leave a cache; `req` is whom the room is for."""
        self._emit(ev.Evict, req, tuple(pages), producer)

    def issue(self, req: str, layers, tokens, nbytes: int, state: bool = False) -> int:
        span = next(self._spans)
        self._emit(ev.Issue, req, span, tuple(layers), tuple(tokens), nbytes, state)
        return span

    def land(self, req: str, span: int, *payload):
        """The span's payload landed (KVLanding.write: per group of K/V layers its kv
        [n, 2, nt, KVH, D] then its digests [n, 2, nt], None: not checked; or a state span's
        conv and recurrent states, each then its digests); over NIXL this call is the writer,
        and its READ has ended when it returns. `land`, or `fail` when its bytes differ from
        the compute-time digests or could not be read; the error text or None. pdref is
        asked first whether the `land` would be accepted (`landing`), so a span it would
        refuse (not in flight, REQ-1; over tokens that already landed, COV-2) writes
        nothing."""
        found = self._check("landing", req, span, audited=True)
        if found is None:
            self._refuse_land(req, span)
        error = self.kv_landing.write(req, found, payload)
        if error is not None:
            return self._fail(req, span, error)
        self._emit(ev.Land, req, span)
        return None

    def _refuse_land(self, req: str, span: int) -> None:
        """The mirror would refuse this land: raise the specification's own Violation (from
        a copy of the state: once, as the run stops)."""
        event = ev.Land(self.now(), req, span)
        try:
            apply(self.live.monitor.state, event)
        except Violation as e:
            raise Violation(e.code, f"{e.message}: nothing written", event) from None
        raise Disagreement(f"the fast mirror refuses {event!r}, the specification accepts it")

    def _fail(self, req: str, span: int, error: str) -> str:
        self.fail(req, span, error)
        self.fence(req, span)  # this process wrote the span and has stopped writing it
        return error

    def fail(self, req: str, span: int, error: str) -> None:
        """The span will not land in this life; its writer may still be busy (unfenced)."""
        self._emit(ev.Fail, req, span, error)

    def fence(self, req: str, span: int) -> None:
        """Contract v2: the writer of a failed or cancelled span has stopped."""
        self._emit(ev.Fence, req, span)

    def produced(self, req: str, token: int) -> None:
        self._emit(ev.Produced, req, token)

    def reuse(self, req: str, tokens) -> None:
        self._emit(ev.Reuse, req, tuple(tokens))

    def admit(self, req: str) -> Context:
        """Admit once pdref says so; where the context to decode with lies."""
        if not self.can_admit(req):
            raise Violation("ADM-1", f"pdref refuses admission of {req!r}: nothing admitted")
        self._emit(ev.Admit, req)
        return self.kv_landing.context(req)

    def release(self, req: str) -> None:
        self._emit(ev.Release, req)
        self._ended(req)

    def abort(self, req: str, reason: str) -> None:
        self._emit(ev.Abort, req, reason)
        self._ended(req)

    def _ended(self, req: str) -> None:
        self.kv_landing.forget(req)
        self.slabs.pop(req, None)
        if self.on_end is not None:
            self.on_end(req)

    def stage(self, req: str, name: str, start: float, end: float, span=None, resource=None,
              batch: int | None = None, kv_tokens: int | None = None):
        start = max(0.0, start)
        self.log.add(ev.Stage(start, req, name, max(start, end), span, resource,
                              batch=batch, kv_tokens=kv_tokens), self.now())

    # -- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """End of a complete run: the live check's end (raises what the audit found)."""
        self.live.close()

    def stop(self) -> Exception | None:
        """The run stopped early: the audit checks what was queued before the stop (bounded
        wait) and ends; what it found (None: nothing). The teardown's aborts and fences are
        then checked by the mirror alone, so the trace still closes with every life ended,
        as it did with the Monitor in line."""
        return self.live.stop()

    def check_metrics(self, wall_s: float) -> dict:
        """Live-check cost beside the run's wall, and the audit's seconds and lag."""
        return self.live.metrics(wall_s)
