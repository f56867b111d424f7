"""The producer's paged KV cache (the *source* of every copy span).

One tensor holds every layer's K and V for `pages * page_tokens` token slots; a request owns
pages listed in its page table, and token t of the request lives in slot
`pages[t // page_tokens] * page_tokens + t % page_tokens`. Page ids come from pdref's
immutable `Pool`, the same allocator the decoder uses.
"""

from __future__ import annotations

import attrs
import torch

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

    kv: torch.Tensor  # [L, 2, slots, KVH, D]
    slots: torch.Tensor  # [prompt] flat slot per position
    pages: tuple[int, ...]

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [n, KVH, D] at positions [start, start+n); K/V [start+n, KVH, D] back."""
        end = start + k.shape[0]
        new = self.slots[start:end]  # [n]
        self.kv[layer, 0].index_copy_(0, new, k)
        self.kv[layer, 1].index_copy_(0, new, v)
        ctx = self.slots[:end]  # [start+n]
        return self.kv[layer, 0].index_select(0, ctx), self.kv[layer, 1].index_select(0, ctx)


class SourceCache:
    """Paged K/V of the producer: `kv` [L, 2, pages * page_tokens, KVH, D] on its device."""

    def __init__(self, geometry: Geometry, pages: int, device, dtype: torch.dtype) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.kv = paged_kv(geometry, pages, self.device, dtype)  # [L, 2, S, KVH, D]
        self.pool = Pool(pages)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def open(self, prompt: int) -> RequestKV:
        """Allocate pages for a request of `prompt` tokens (lowest free ids first)."""
        self.pool, pages = self.pool.allocate(self.geometry.pages_for(prompt))
        slots = token_slots(pages, self.geometry.page_tokens, prompt, self.device)
        return RequestKV(self.kv, slots, pages)

    def close(self, request: RequestKV) -> None:
        """Give the request's pages back: the next request may overwrite them at once."""
        self.pool = self.pool.give_back(request.pages)


def gather(kv: torch.Tensor, slots: torch.Tensor, layers: Range, tokens: Range, out) -> None:
    """Copy region layers x tokens of a request out of the pages into `out`.

    kv [L, 2, S, KVH, D], slots [prompt]; out [nl, 2, nt, KVH, D] preallocated.
    """
    index = slots[tokens[0]:tokens[1]]  # [nt], a view: nothing allocated
    torch.index_select(kv[layers[0]:layers[1]], 2, index, out=out)
