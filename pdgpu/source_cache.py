"""The producer's paged KV cache (the *source* of every copy span).

One tensor holds every layer's K and V for `pages * page_tokens` token slots; a request owns
pages listed in its page table, and token t of the request lives in slot
`pages[t // page_tokens] * page_tokens + t % page_tokens`. Page ids come from pdref's
immutable `Pool`, the same allocator the decoder uses.

Attention does not read the pages. The request being prefilled also keeps its K/V in a
contiguous *workspace* ([L, 2, KVH, tokens, D], reused by the next request), so a chunk
attends over a view of it (attention.py) instead of gathering its whole context out of the
pages: a chunk's extra memory traffic is its own rows (pages and workspace), whatever the
context. One request is prefilled at a time per cache (the engine and a serving producer
both work so). Rows [0, prefix) of the workspace are written by the prefix's own prefill and
by no request after it (each writes [prefix, prompt)), so they stay valid across requests.

A hybrid with linear layers (gated DeltaNet) also keeps each open request's state in a slot
of the cache's state pool (state_pool.py), zeroed when the request opens: those layers read
and update it chunk after chunk instead of K/V.
"""

from __future__ import annotations

import attrs
import torch

from pdgpu.state_pool import StatePool, StateShape
from pdref.geometry import Geometry
from pdref.intervals import Range
from pdref.pool import Pool


def paged_kv(geometry: Geometry, pages: int, device: torch.device, dtype) -> torch.Tensor:
    """Zeroed K/V for `pages` pages of every layer -> [L, 2, pages * page_tokens, KVH, D]."""
    shape = (geometry.layers, 2, pages * geometry.page_tokens, geometry.kv_heads,
             geometry.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def token_slots(pages: tuple[int, ...], page_tokens: int, tokens: int, device) -> torch.Tensor:
    """Flat slot of each of `tokens` positions laid out over `pages` -> [tokens] int64."""
    page_ids = torch.tensor(pages, dtype=torch.int64)  # [P]
    offsets = torch.arange(page_tokens, dtype=torch.int64)  # [T]
    slots = (page_ids[:, None] * page_tokens + offsets[None, :]).reshape(-1)  # [P*T]
    return slots[:tokens].to(device)


@attrs.frozen
class RequestKV:
    """One request's view of the source cache: the KVStore the model writes through."""

    kv: torch.Tensor  # [L, 2, slots, KVH, D] the pages: every span's copy source
    slots: torch.Tensor  # [prompt] flat slot per position
    pages: tuple[int, ...]
    work: torch.Tensor  # [L, 2, KVH, >= prompt, D] the workspace attention reads
    state_pool: StatePool | None = None  # a hybrid's linear-layer states
    state_slot: int | None = None  # this request's slot in it

    def states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear layer `layer`'s state of this request: conv [C, K-1], recurrent
        [Hv, Dk, Dv] (views: prefill updates them in place)."""
        return self.state_pool.views(layer, self.state_slot)

    def read_state(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A copy of the request's whole state (None for a model without linear layers)."""
        return None if self.state_pool is None else self.state_pool.read(self.state_slot)

    def append(self, layer: int, start: int, kv: torch.Tensor):
        """Store kv [n, 2, KVH, D] (K, V) at positions [start, start+n) in the pages and the
        workspace (one op each); K/V [KVH, start+n, D] back (views of the workspace)."""
        end = start + kv.shape[0]
        self.kv[layer].index_copy_(1, self.slots[start:end], kv.transpose(0, 1))  # [2, n, ..]
        self.work[layer, :, :, start:end] = kv.permute(1, 2, 0, 3)  # [2, KVH, n, D]
        return self.work[layer, 0, :, :end], self.work[layer, 1, :, :end]  # views


class SourceCache:
    """Paged K/V of the producer: `kv` [L, 2, pages * page_tokens, KVH, D] on its device."""

    def __init__(self, geometry: Geometry, pages: int, device, dtype: torch.dtype,
                 state: StateShape | None = None) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.kv = paged_kv(geometry, pages, self.device, dtype)  # [L, 2, S, KVH, D]
        self.work = self._workspace(0)  # [L, 2, KVH, tokens, D], grown on demand
        self.pool = Pool(pages)
        self.states = None if state is None else StatePool(state, 1, self.device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def open(self, prompt: int, state_slot: int | None = None) -> RequestKV:
        """Allocate pages for a request of `prompt` tokens (lowest free ids first) and, of a
        hybrid, a state slot: `state_slot` when the protocol named one (the engine asks
        pdref's `free_state_slot`: its answer is the slot), else the lowest free."""
        self.pool, pages = self.pool.allocate(self.geometry.pages_for(prompt))
        slots = token_slots(pages, self.geometry.page_tokens, prompt, self.device)
        return self.view(slots, pages, self._state_slot(state_slot))

    def _state_slot(self, named: int | None) -> int | None:
        """The request's state slot: the one named (claimed), else the lowest free."""
        if self.states is None:
            return None
        if named is None:
            return self.states.take()
        self.states.claim(named)
        return named

    def view(self, slots: torch.Tensor, pages: tuple[int, ...],
             state_slot: int | None = None) -> RequestKV:
        """The KVStore of a request laid out over `pages` (slots [prompt]), workspace grown
        to its length (earlier rows kept: the prefix's stay valid), its state in
        `state_slot` of the state pool (a hybrid's)."""
        if self.work.shape[3] < len(slots):
            grown = self._workspace(len(slots))
            grown[:, :, :, :self.work.shape[3]] = self.work
            self.work = grown
        return RequestKV(self.kv, slots, pages, self.work, self.states, state_slot)

    def _workspace(self, tokens: int) -> torch.Tensor:
        g = self.geometry
        return torch.zeros((g.layers, 2, g.kv_heads, tokens, g.head_dim), dtype=self.kv.dtype,
                           device=self.device)

    def close(self, request: RequestKV) -> None:
        """Give the request's pages back: the next request may overwrite them at once."""
        self.pool = self.pool.give_back(request.pages)
        if request.state_slot is not None:
            self.states.give_back(request.state_slot)


def gather(kv: torch.Tensor, slots: torch.Tensor, layers: Range, tokens: Range, out) -> None:
    """Copy region layers x tokens of a request out of the pages into `out`.

    kv [L, 2, S, KVH, D], slots [prompt]; out [nl, 2, nt, KVH, D] preallocated.
    """
    index = slots[tokens[0]:tokens[1]]  # [nt], a view: nothing allocated
    torch.index_select(kv[layers[0]:layers[1]], 2, index, out=out)
