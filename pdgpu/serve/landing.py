"""The decoder's KV landing: where a span's bytes go and whether they arrived intact. It moves
and checks bytes and decides nothing: the Ledger (ledger.py), pdref's authority in this
process, asks pdref first and tells it after; this component only does what it was told.

It owns the decoder's handoff memory: the paged pool of slabs [Lkv, 2, S, KVH, D] (the K/V
layers only), each live request's token slots in it, and for a model with linear layers a
landing slot of state per request (a `StatePool`). `open` maps a reserved slab's pages to
token slots; `write` puts a span's payload into them (lanes hand a tensor, the NIXL lane a
RemoteSlice that is READ straight into the pages here) and checks the landed rows against the
producer's compute-time digests (`--verify`, its cost in `verify_s`); `context` gathers an
admitted request's context K/V for its decode; `forget` lets a request's slots go.
Payloads (contract v3, pdgpu/handoff.py): a KV span is one tensor per group of its K/V layers
(a sliding layer's rows are only its window's), each followed by its digests; a state span is
the conv windows [ns, C, K-1] and the recurrent states [ns, Hv, Dk, Dv] of its linear layers,
each followed by its digests.
"""

from __future__ import annotations

import time

import torch

from pdgpu.handoff import kv_geometry, kv_groups, state_range
from pdgpu.serve.digest import first_mismatch, state_rows
from pdgpu.serve.link import local, rows_into
from pdgpu.serve.rendezvous import TransportError
from pdgpu.source_cache import paged_kv, token_slots
from pdgpu.state_pool import StatePool, StateShape
from pdref.geometry import Geometry


class KVLanding:
    """The decoder's handoff memory and the bytes put into it (see the module docstring)."""

    def __init__(self, geometry: Geometry, pool_pages: int, device, dtype: torch.dtype,
                 state: StateShape | None = None) -> None:
        if geometry.recurrent and state is None:
            raise ValueError("ledger: a geometry with linear layers needs the state's shape")
        self.geometry = geometry
        # [Lkv, 2, S, KVH, D]: the K/V layers only (a hybrid's linear layers keep none)
        self.kv = paged_kv(kv_geometry(geometry), pool_pages, device, dtype)
        self.slots: dict[str, torch.Tensor] = {}  # req -> [prompt - prefix] pool slot per token
        self.prefixes: dict[str, int] = {}  # req -> its reserve's prefix (slot 0's token)
        self.prompts: dict[str, int] = {}
        # the landed states of live requests, one slot each (a hybrid with linear layers)
        self.states = None if not geometry.recurrent else StatePool(state, 1, device)
        self.state_slots: dict[str, int] = {}  # req -> its landing slot in `states`
        self.verify_s = 0.0  # spent checking landed bytes against their checksums

    @property
    def keeps_state(self) -> bool:
        """The model has linear layers: each request lands a state too."""
        return self.states is not None

    def open(self, req: str, pages, prompt: int, prefix: int) -> None:
        """A slab was reserved on `pages`: its token slots (and a state landing slot)."""
        self.slots[req] = token_slots(pages, self.geometry.page_tokens, prompt - prefix,
                                      self.kv.device)
        self.prefixes[req], self.prompts[req] = prefix, prompt
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

    def context(self, req: str, prefix_kv: torch.Tensor) -> torch.Tensor:
        """An admitted request's context K/V [L, 2, prompt, KVH, D]: the shared prefix's,
        then its slab's rows gathered in token order."""
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

    def forget(self, req: str) -> None:
        """A life ended: its slab's slots and its landing slot (if still held) go."""
        self.slots.pop(req, None)
        self.prefixes.pop(req, None)
        self.prompts.pop(req, None)
        slot = self.state_slots.pop(req, None)
        if slot is not None:
            self.states.give_back(slot)
