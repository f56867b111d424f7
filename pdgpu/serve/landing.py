"""The decoder's KV landing: where a span's bytes go and whether they arrived intact. It moves
and checks bytes and decides nothing: the Ledger (ledger.py), pdref's authority in this
process, asks pdref first and tells it after; this component only does what it was told.

It owns the decoder's handoff memory, the one place a request's context lies until its
decode row takes it: the paged pool [Lkv, 2, S, KVH, D] (the K/V layers only) of pdref's
slab pages and, after them, the pages of the fixed prefix (`--prefix`: warmed once, outside
pdref's pool: `reserve.prefix` covers it), each live request's token slots in it, and for a
model with linear layers a landing slot of state per request in a `StatePool` that the
decode cache shares (decode_kv.py: the state is landed once where the decode step reads it).
`open` maps the prefix's pages and a reserved slab's pages to the request's token slots;
`write` puts a span's payload into them (lanes hand a tensor, the NIXL lane a RemoteSlice
that is READ straight into the pages here) and checks the landed rows against the producer's
compute-time digests (`--verify`, its cost in `verify_s`); `context` names where an admitted
request's context lies (the pool, its slots in token order, its state slot), for the decode
cache's one gather; `forget` lets a request's slots go.
Payloads (contract v3, pdgpu/handoff.py): a KV span is one tensor per group of its K/V layers
(a sliding layer's rows are only its window's), each followed by its digests; a state span is
the conv windows [ns, C, K-1] and the recurrent states [ns, Hv, Dk, Dv] of its linear layers,
each followed by its digests.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from pdgpu.handoff import kv_geometry, kv_groups, state_range
from pdgpu.serve.digest import first_mismatch, state_rows
from pdgpu.serve.link import local, rows_into
from pdgpu.serve.rendezvous import TransportError
from pdgpu.source_cache import paged_kv, token_slots
from pdgpu.state_pool import StatePool, StateShape
from pdref.geometry import Geometry


class Context(NamedTuple):
    """Where an admitted request's context lies: for DecodeCache.add_paged."""

    kv: torch.Tensor  # [Lkv, 2, S, KVH, D] the landing pool
    slots: torch.Tensor  # [prompt] the pool slot of each token, in token order
    state_slot: int | None  # its landed state's slot in the shared StatePool (hybrids)

    @property
    def parts(self) -> tuple:
        """Its K/V as DecodeCache.add_paged takes it: one piece, the pool at its slots."""
        return ((self.kv, self.slots),)


class KVLanding:
    """The decoder's handoff memory and the bytes put into it (see the module docstring)."""

    def __init__(self, geometry: Geometry, pool_pages: int, device, dtype: torch.dtype,
                 state: StateShape | None = None, prefix_kv: torch.Tensor | None = None) -> None:
        if geometry.recurrent and state is None:
            raise ValueError("ledger: a geometry with linear layers needs the state's shape")
        self.geometry = geometry
        prefix = 0 if prefix_kv is None else prefix_kv.shape[2]
        prefix_pages = tuple(range(pool_pages, pool_pages + geometry.pages_for(prefix)))
        # [Lkv, 2, S, KVH, D]: the K/V layers only (a hybrid's linear layers keep none)
        self.kv = paged_kv(kv_geometry(geometry), pool_pages + len(prefix_pages), device,
                           dtype)
        # [prefix] the fixed prefix's slots, its K/V written there once
        self.prefix_slots = token_slots(prefix_pages, geometry.page_tokens, prefix, device)
        if prefix_kv is not None:
            self.kv.index_copy_(2, self.prefix_slots, prefix_kv.to(self.kv.device))
        self.slots: dict[str, torch.Tensor] = {}  # req -> [prompt] pool slot per token
        self.prefixes: dict[str, int] = {}  # req -> its reserve's prefix (covered already)
        # the landed states of live requests, one slot each (a hybrid with linear layers)
        self.states = None if not geometry.recurrent else StatePool(state, 1, device)
        self.state_slots: dict[str, int] = {}  # req -> its landing slot in `states`
        self.verify_s = 0.0  # spent checking landed bytes against their checksums

    @property
    def keeps_state(self) -> bool:
        """The model has linear layers: each request lands a state too."""
        return self.states is not None

    def open(self, req: str, pages, prompt: int, prefix: int, hit=()) -> None:
        """A slab was reserved on `pages` for tokens [prefix, prompt): the request's token
        slots, its prefix's (the cached pages `hit`, else the fixed prefix) then the slab's
        (and a state landing slot)."""
        pt, device = self.geometry.page_tokens, self.kv.device
        before = token_slots(hit, pt, prefix, device) if hit else self.prefix_slots
        if prefix > before.shape[0]:
            raise ValueError(f"landing: prefix {prefix} is longer than the decoder's prefix "
                             f"cache ({before.shape[0]} tokens)")
        slab = token_slots(pages, pt, prompt - prefix, device)
        self.slots[req] = torch.cat((before[:prefix], slab))  # [prompt]
        self.prefixes[req] = prefix
        if self.states is not None:
            self.state_slots[req] = self.states.take()

    def write(self, req: str, found, payload) -> str | None:
        """The span pdref located (`found`: its layers, tokens and state slot) written from
        `payload`; None, or the error text (a wrong shape: nothing written; bytes that could
        not be read, or differ from their digests)."""
        state = found.slot is not None
        try:
            return (self._write_state if state else self._write_kv)(req, found, payload)
        except TransportError as e:
            return f"{'state' if state else 'KV'} not read: {e}"

    def _write_kv(self, req: str, found, payload) -> str | None:
        """A KV span's groups into the slab (nothing written when a shape is wrong)."""
        slots = self.slots[req]  # [prompt]
        groups = kv_groups(self.geometry, found.layers, found.tokens, slots.shape[0],
                           self.prefixes[req])
        shapes = [tuple(kv.shape[:3]) for kv in payload[0::2]]
        if shapes != [(l1 - l0, 2, b - a) for (l0, l1), (a, b) in groups]:
            (l0, l1), (a, b) = found.layers, found.tokens
            return (f"payload shapes {[list(s) for s in shapes]} do not match layers "
                    f"[{l0}, {l1}) x tokens [{a}, {b})")
        for ((l0, l1), (a, b)), kv, digests in zip(groups, payload[0::2], payload[1::2],
                                                   strict=True):
            index = slots[a:b]  # [nt]
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

    def context(self, req: str) -> Context:
        """Where admitted request `req`'s context lies (its landed state's slot now the
        decode cache's: `forget` no longer gives it back)."""
        return Context(self.kv, self.slots[req], self.state_slots.pop(req, None))

    def forget(self, req: str) -> None:
        """A life ended: its slab's slots and its landing slot (if still held) go."""
        self.slots.pop(req, None)
        self.prefixes.pop(req, None)
        slot = self.state_slots.pop(req, None)
        if slot is not None:
            self.states.give_back(slot)
