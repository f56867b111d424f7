"""The decoder's one door to the handoff pool: every resource operation is one call with its
pdref event, and is refused (raises Violation, nothing done) when the live Monitor refuses it.

reserve -> pages of a slab | issue -> a span id | land -> the span's bytes written into the
slab, checked against the producer's compute-time digests (`--verify`): `land` or `fail` |
reuse -> the producer may free its source pages | admit -> the request's context K/V |
release / abort -> pages back. The Monitor is the authority for every process of the run.
Every accepted event goes to the run's TraceLog (written while the run goes).
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from pdgpu.serve.digest import first_mismatch
from pdgpu.serve.tracelog import TraceLog
from pdgpu.source_cache import paged_kv, token_slots
from pdref import events as ev
from pdref.apply import apply
from pdref.monitor import Monitor
from pdref.violations import Violation


class Ledger:
    def __init__(self, header: ev.Header, device, dtype: torch.dtype,
                 log: TraceLog | None = None) -> None:
        self.header = header
        self.geometry = header.geometry
        self.log = log if log is not None else TraceLog(header, None)
        self.recent: deque = deque(maxlen=8)  # the last protocol events (for tests, errors)
        self.monitor = Monitor(header, sink=self._record)
        self.kv = paged_kv(self.geometry, header.pool_pages, device, dtype)  # [L, 2, S, KVH, D]
        self.slots: dict[str, torch.Tensor] = {}  # req -> [prompt - prefix] pool slot per token
        self.peak_pages = 0
        self.verify_s = 0.0  # spent checking landed bytes against their checksums
        self._spans = itertools.count()
        self.t0 = time.perf_counter()

    def _record(self, event) -> None:
        self.recent.append(event)
        self.log.add(event)

    def restart_clock(self) -> None:
        if self.monitor.events:
            raise RuntimeError("the clock can only restart before the first event")
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def trace_time(self, absolute: float) -> float:
        """A perf_counter reading of this process as trace time (never before 0)."""
        return max(0.0, absolute - self.t0)

    def _emit(self, cls, *fields):
        self.monitor.emit(cls(self.now(), *fields))

    # -- queries ------------------------------------------------------------------------------

    def can_reserve(self, prompt: int, prefix: int) -> bool:
        return self.monitor.can_reserve(prompt, prefix)

    def in_flight(self, req: str) -> int:
        life = self.monitor.state.live(req)
        return len(life.in_flight) if life is not None else 0

    @property
    def used_pages(self) -> int:
        return self.header.pool_pages - self.monitor.free_pages

    @property
    def leaked_pages(self) -> int:
        """Pages not in pdref's free pool (held by a slab or quarantined)."""
        return self.header.pool_pages - len(self.monitor.free_page_ids())

    # -- operations ---------------------------------------------------------------------------

    def reserve(self, req: str, prompt: int, prefix: int, producer: str) -> None:
        pages = self.monitor.reserve(self.now(), req, prompt, prefix, producer)
        self.slots[req] = token_slots(pages, self.geometry.page_tokens, prompt - prefix,
                                      self.kv.device)
        self.peak_pages = max(self.peak_pages, self.used_pages)

    def computed(self, req: str, layers, tokens) -> None:
        self._emit(ev.Computed, req, tuple(layers), tuple(tokens))

    def issue(self, req: str, layers, tokens, nbytes: int) -> int:
        span = next(self._spans)
        self._emit(ev.Issue, req, span, tuple(layers), tuple(tokens), nbytes)
        return span

    def land(self, req: str, span: int, kv: torch.Tensor, digests: torch.Tensor | None):
        """Write the span's kv [nl, 2, nt, KVH, D] into the slab; `land`, or `fail` when its
        bytes in the slab differ from the compute-time digests. The error text or None.
        The `land` is tried on the current state first (pure), so a span pdref would refuse
        (e.g. over tokens that already landed, COV-2) writes nothing."""
        life = self.monitor.state.live(req)
        found = life.find_span(span) if life is not None else None
        if found is None:
            raise Violation("REQ-1", f"span {span} of {req!r} is not in flight: nothing written")
        (l0, l1), (a, b) = found.layers, found.tokens
        if tuple(kv.shape[:3]) != (l1 - l0, 2, b - a):
            return self._fail(req, span, f"payload shape {list(kv.shape)} does not match "
                                         f"layers [{l0}, {l1}) x tokens [{a}, {b})")
        apply(self.monitor.state, ev.Land(self.now(), req, span))  # refused: nothing written
        prefix = life.prefix
        index = self.slots[req][a - prefix:b - prefix]  # [nt]
        self.kv[l0:l1].index_copy_(2, index, kv.to(self.kv.device))
        if digests is not None:
            start = time.perf_counter()
            bad = first_mismatch(self.kv[l0:l1].index_select(2, index), digests.to(index.device))
            self.verify_s += time.perf_counter() - start  # --verify's cost, in the loop
            if bad is not None:
                return self._fail(req, span, f"checksum mismatch at layer {l0 + bad[0]} "
                                             f"token {a + bad[1]}")
        self._emit(ev.Land, req, span)
        return None

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
        if not self.monitor.can_admit(req):
            raise Violation("ADM-1", f"pdref refuses admission of {req!r}: nothing admitted")
        self._emit(ev.Admit, req)
        suffix = self.kv.index_select(2, self.slots[req])  # [L, 2, suffix, KVH, D]
        return torch.cat([prefix_kv.to(suffix.device), suffix], dim=2)

    def release(self, req: str) -> None:
        self._emit(ev.Release, req)
        del self.slots[req]

    def abort(self, req: str, reason: str) -> None:
        self._emit(ev.Abort, req, reason)
        self.slots.pop(req, None)

    def stage(self, req: str, name: str, start: float, end: float, span=None, resource=None,
              batch: int | None = None, kv_tokens: int | None = None):
        start = max(0.0, start)
        self.log.add(ev.Stage(start, req, name, max(start, end), span, resource,
                              batch=batch, kv_tokens=kv_tokens))
