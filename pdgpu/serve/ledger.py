"""The decoder's one door to the handoff pool: every resource operation is one call with its
pdref event, and is refused (raises Violation, nothing done) when the live check refuses it.

reserve -> pages of a slab (and, for a model with linear layers, the producer's state slot
pdref names free, and a landing slot of the decoder's state pool) | issue -> a span id |
land -> the span's bytes written into the slab (a state span's into the landing slot),
checked against the producer's compute-time digests (`--verify`): `land` or `fail` |
reuse -> the producer may free its source pages | admit -> the request's context K/V (and
`take_state`: its landed state) | release / abort -> pages and slots back. pdref is the
authority for every process of the run.
Contract v3 (a hybrid, pdgpu/handoff.py): spans name model layers; the slabs hold the K/V
layers only, and a KV span's payload is one tensor per group of its K/V layers (a sliding
layer's rows are only its window's), each followed by its digests; a state span's payload is
the conv windows [ns, C, K-1] and the recurrent states [ns, Hv, Dk, Dv] of its linear layers,
each followed by its digests.
Every accepted event goes to the run's TraceLog (written while the run goes).

Live checks off the critical path (as pdgpu/recorder.py does for the engine): pdref's
`FastMonitor` (the mutable mirror) gives every verdict and answers every query the decoder
decides with, in line; every accepted event and every such answer also goes to the audit
thread (pdgpu/audit.py), which replays them into the specification's `Monitor`. What it
refuses, or answers differently, is raised at the decoder's next call into the ledger or
at the next turn of its loop (`raise_audit_error`), at most `audit.BOUND` events later
(backpressure), and at the end of the run, which waits for the audit (`close`). The
decoder never reads pdref's state (on the mirror that copies all of it): `landing` tells
whether a span may land, and where, before its bytes are written.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from pdgpu.audit import BOUND, Disagreement
from pdgpu.handoff import kv_geometry, kv_groups, state_range
from pdgpu.live_check import LiveCheck
from pdgpu.serve.digest import first_mismatch, state_rows
from pdgpu.serve.link import local, rows_into
from pdgpu.serve.rendezvous import TransportError
from pdgpu.serve.tracelog import TraceLog
from pdgpu.source_cache import paged_kv, token_slots
from pdgpu.state_pool import StatePool, StateShape
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
                 audit_bound: int = BOUND, state: StateShape | None = None) -> None:
        self.header = header
        self.geometry = header.geometry
        self.log = log if log is not None else TraceLog(header, None)
        self.recent: deque = deque(maxlen=8)  # the last protocol events (for tests, errors)
        self._accepted: list = []  # accepted by the mirror, not yet in the trace
        self.live = LiveCheck(header, self._accepted.append, audit_monitor=audit_monitor,
                              audit_bound=audit_bound)
        # [Lkv, 2, S, KVH, D]: the K/V layers only (a hybrid's linear layers keep none)
        self.kv = paged_kv(kv_geometry(self.geometry), header.pool_pages, device, dtype)
        self.slots: dict[str, torch.Tensor] = {}  # req -> [prompt - prefix] pool slot per token
        self.prefixes: dict[str, int] = {}  # req -> its reserve's prefix (slot 0's token)
        self.prompts: dict[str, int] = {}
        if self.geometry.recurrent and state is None:
            raise ValueError("ledger: a geometry with linear layers needs the state's shape")
        # the landed states of live requests, one slot each (a hybrid with linear layers)
        self.states = None if not self.geometry.recurrent else StatePool(state, 1, device)
        self.state_slots: dict[str, int] = {}  # req -> its landing slot in `states`
        self.peak_pages = 0
        self.verify_s = 0.0  # spent checking landed bytes against their checksums
        self._spans = itertools.count()
        self.t0 = time.perf_counter()

    @property
    def audit(self):
        """The audit thread behind the mirror (the live check's)."""
        return self.live.audit

    @property
    def monitor(self):
        """pdref's fast mirror (the live check's)."""
        return self.live.monitor

    def restart_clock(self) -> None:
        if self.monitor.events:
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

    def unfenced(self, req: str) -> tuple:
        """Span ids of `req` whose writer has not been fenced yet."""
        return self._check("unfenced", req, audited=True)

    @property
    def used_pages(self) -> int:  # a metric (the peak), not a decision: not audited
        return self.header.pool_pages - self.monitor.free_pages

    @property
    def leaked_pages(self) -> int:
        """Pages not in pdref's free pool (held by a slab or quarantined)."""
        return self.header.pool_pages - len(self.monitor.free_page_ids())

    # -- operations ---------------------------------------------------------------------------

    def reserve(self, req: str, prompt: int, prefix: int, producer: str) -> int | None:
        """Reserve a slab; the producer's state slot the life computes into (a model with
        linear layers: the lowest that pdref has free for `producer`), or None."""
        slot = None
        if self.states is not None:
            slot = self._check("free_state_slot", producer, audited=True)
        pages = self._check("reserve", self.now(), req, prompt, prefix, producer, slot)
        self.slots[req] = token_slots(pages, self.geometry.page_tokens, prompt - prefix,
                                      self.kv.device)
        self.prefixes[req], self.prompts[req] = prefix, prompt
        if self.states is not None:
            self.state_slots[req] = self.states.take()
        self.peak_pages = max(self.peak_pages, self.used_pages)
        return slot

    def computed(self, req: str, layers, tokens) -> None:
        self._emit(ev.Computed, req, tuple(layers), tuple(tokens))

    def issue(self, req: str, layers, tokens, nbytes: int, state: bool = False) -> int:
        span = next(self._spans)
        self._emit(ev.Issue, req, span, tuple(layers), tuple(tokens), nbytes, state)
        return span

    def land(self, req: str, span: int, *payload):
        """Write the span's payload into the slab: per group (handoff.kv_groups; one for a
        dense model) its kv [n, 2, nt, KVH, D] then its digests [n, 2, nt] (None: not
        checked), or a state span's conv and recurrent states, each then its digests, into
        the request's landing slot. A tensor, or the NIXL lane's RemoteSlice, READ straight
        into the pages: then this call is the writer, and its READ has ended when it
        returns. `land`, or `fail` when its bytes differ from the compute-time digests or
        could not be read; the error text or None. pdref is asked first whether the `land`
        would be accepted (`landing`), so a span it would refuse (not in flight, REQ-1; over
        tokens that already landed, COV-2) writes nothing."""
        found = self._check("landing", req, span, audited=True)
        if found is None:
            self._refuse_land(req, span)
        write = self._write_state if found.slot is not None else self._write_kv
        try:
            error = write(req, found, payload)
        except TransportError as e:
            error = f"{'state' if found.slot is not None else 'KV'} not read: {e}"
        if error is not None:
            return self._fail(req, span, error)
        self._emit(ev.Land, req, span)
        return None

    def _write_kv(self, req: str, found, payload) -> str | None:
        """A KV span's groups into the slab (nothing written when a shape is wrong)."""
        prefix = self.prefixes[req]
        groups = kv_groups(self.geometry, found.layers, found.tokens, self.prompts[req], prefix)
        shapes = [tuple(kv.shape[:3]) for kv in payload[0::2]]
        if shapes != [(l1 - l0, 2, b - a) for (l0, l1), (a, b) in groups]:
            (l0, l1), (a, b) = found.layers, found.tokens
            return (f"payload shapes {[list(s) for s in shapes]} do not match layers "
                    f"[{l0}, {l1}) x tokens [{a}, {b})")
        for ((l0, l1), (a, b)), kv, digests in zip(groups, payload[0::2], payload[1::2],
                                                   strict=True):
            index = self.slots[req][a - prefix:b - prefix]  # [nt]
            rows_into(self.kv[l0:l1], kv, index)  # over NIXL: READ into the pages here
            error = self._verify(self.kv[l0:l1].index_select(2, index), digests)
            if error is not None:
                return f"{error[0]} at layer {l0 + error[1][0]} token {a + error[1][1]}"
        return None

    def _write_state(self, req: str, found, payload) -> str | None:
        """A state span's conv windows and recurrent states into the request's landing
        slot (nothing written when a shape is wrong)."""
        s0, s1 = state_range(self.geometry, found.layers)
        shape, slot = self.states.shape, self.state_slots[req]
        want = [(s1 - s0, *shape.conv), (s1 - s0, *shape.recurrent)]
        got = [tuple(t.shape) for t in payload[0::2]]
        if got != want:
            return f"state payload shapes {got} do not match {want} (linear layers {s0}..{s1})"
        kept = (self.states.conv[s0:s1, slot], self.states.recurrent[s0:s1, slot])
        for name, into, data, digests in zip(("conv", "recurrent"), kept, payload[0::2],
                                             payload[1::2], strict=True):
            into.copy_(local(data, into.device))
            error = self._verify(state_rows(into), digests)
            if error is not None:
                return f"{error[0]} in the {name} state of linear layer {s0 + error[1][0]}"
        return None

    def _verify(self, landed: torch.Tensor, digests):
        """Landed rows against their digests (None: not asked): None, or ("checksum
        mismatch", the first differing row's index)."""
        if digests is None:
            return None
        start = time.perf_counter()
        bad = first_mismatch(landed, local(digests, landed.device))
        self.verify_s += time.perf_counter() - start  # --verify's cost, in the loop
        return None if bad is None else ("checksum mismatch", bad)

    def _refuse_land(self, req: str, span: int) -> None:
        """The mirror would refuse this land: raise the specification's own Violation (from
        a copy of the state: once, as the run stops)."""
        event = ev.Land(self.now(), req, span)
        try:
            apply(self.monitor.state, event)
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

    def admit(self, req: str, prefix_kv: torch.Tensor) -> torch.Tensor:
        """Admit once pdref says so; the context K/V [L, 2, prompt, KVH, D] to decode with."""
        if not self.can_admit(req):
            raise Violation("ADM-1", f"pdref refuses admission of {req!r}: nothing admitted")
        self._emit(ev.Admit, req)
        suffix = self.kv.index_select(2, self.slots[req])  # [L, 2, suffix, KVH, D]
        return torch.cat([prefix_kv.to(suffix.device), suffix], dim=2)

    def take_state(self, req: str):
        """An admitted request's landed state (StatePool.read's pair: conv [NL, C, K-1],
        recurrent [NL, Hv, Dk, Dv]) for its decode, its landing slot given back; None for a
        model without linear layers."""
        slot = self.state_slots.pop(req, None)
        if slot is None:
            return None
        state = self.states.read(slot)
        self.states.give_back(slot)
        return state

    def release(self, req: str) -> None:
        self._emit(ev.Release, req)
        self._forget(req)

    def abort(self, req: str, reason: str) -> None:
        self._emit(ev.Abort, req, reason)
        self._forget(req)

    def _forget(self, req: str) -> None:
        """A life ended: its slab's slots and its landing slot (if still held) go."""
        self.slots.pop(req, None)
        self.prefixes.pop(req, None)
        self.prompts.pop(req, None)
        slot = self.state_slots.pop(req, None)
        if slot is not None:
            self.states.give_back(slot)

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
