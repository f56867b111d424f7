"""The decoder's paged KV pool: slabs reserved through pdref, spans imported into them.

Which pages a slab gets is decided by pdref (`Monitor.reserve`, its functional allocator);
this module holds the tensor, moves bytes, and keeps a free list that follows the
specification's pool and never runs ahead of it: `take` the pages a reserve gave (refused if
this pool still holds one), `follow` gives back only pages the specification has free again
(after a release, or after an abort once its last writer was fenced). `write_span` imports a
region into the slab's pages and publishes nothing: coverage and admission live in pdref.
"""

from __future__ import annotations

import attrs
import torch

from pdgpu.source_cache import paged_kv, token_slots
from pdgpu.state_pool import StatePool, StateShape
from pdref.geometry import Geometry
from pdref.intervals import Range


@attrs.frozen
class Slab:
    """Pages reserved for tokens [prefix, prompt) of one request."""

    pages: tuple[int, ...]
    prefix: int
    prompt: int
    slots: torch.Tensor  # [prompt - prefix] flat pool slot per suffix position


class DecoderPool:
    """`kv` [L, 2, pool_pages * page_tokens, KVH, D] on the decoder device (the K/V layers);
    of a hybrid with linear layers also `states`, a state slot per reserved life, where its
    state spans land."""

    def __init__(self, geometry: Geometry, pool_pages: int, device, dtype: torch.dtype,
                 state: StateShape | None = None) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.kv = paged_kv(geometry, pool_pages, self.device, dtype)  # [L, 2, S, KVH, D]
        self.states = None if state is None else StatePool(state, 1, self.device)
        self.held: frozenset[int] = frozenset()  # pages some slab (or its late writer) holds

    def take(self, pages: tuple[int, ...]) -> None:
        """Hold the pages the specification's reserve gave; refused while one is still held
        here (the specification handed it out before this pool got it back)."""
        clash = self.held.intersection(pages)
        if clash:
            raise RuntimeError(f"decoder pool: page {min(clash)} is given out again while "
                               "still held here")
        self.held = self.held.union(pages)

    def follow(self, spec_free_ids) -> tuple[int, ...]:
        """Give back every held page that the specification's pool has free (`spec_free_ids`,
        e.g. `Monitor.free_page_ids()`: quarantined pages are not in it); the pages given back."""
        back = tuple(sorted(self.held.intersection(spec_free_ids)))
        self.held = self.held.difference(back)
        return back

    def slab(self, pages: tuple[int, ...], prefix: int, prompt: int) -> Slab:
        slots = token_slots(pages, self.geometry.page_tokens, prompt - prefix, self.device)
        return Slab(tuple(pages), prefix, prompt, slots)

    def write_span(self, slab: Slab, layers: Range, tokens: Range, kv: torch.Tensor) -> None:
        """Import kv [nl, 2, nt, KVH, D] as layers x tokens of the slab (no allocation)."""
        index = slab.slots[tokens[0] - slab.prefix:tokens[1] - slab.prefix]  # [nt] view
        self.kv[layers[0]:layers[1]].index_copy_(2, index, kv)

    def read_slab(self, slab: Slab) -> torch.Tensor:
        """A CPU copy of the slab's KV [L, 2, prompt - prefix, KVH, D] (for parity checks)."""
        return self.kv.index_select(2, slab.slots).cpu()

    def scrub(self, slab: Slab) -> None:
        """Fill the slab's slots with NaN so a later reader of stale KV cannot pass parity."""
        self.kv.index_fill_(2, slab.slots, float("nan"))
