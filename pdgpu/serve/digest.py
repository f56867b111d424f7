"""Span checksums taken when KV is *computed*, checked when it lands (`--verify`).

A row digest is an exact integer function of the bytes of one (layer, K|V, token) row:
sum over its elements of (element bits as an integer) x (a fixed odd weight), mod 2**64.
Integer sums are exact in any order, so producer and decoder agree on any device; a dropped,
shifted, stale or overwritten row changes its digest. The producer's `DigestingKV` records
each row's digest as the model writes it into the source cache, so a page overwritten before
its copy is gathered is caught too, not only a broken copy.
"""

from __future__ import annotations

import functools

import torch

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@functools.lru_cache(maxsize=16)
def _weights(width: int, device: torch.device) -> torch.Tensor:
    """The fixed odd weights, made once per width and device (on CUDA: no host RNG and copy
    per digest call)."""
    gen = torch.Generator().manual_seed(0x5EED)
    w = torch.randint(1, 2**62, (width,), generator=gen, dtype=torch.int64) * 2 + 1  # odd
    return w.to(device)  # [KVH * D]


def row_digests(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [..., KVH, D] (float) -> int64 [...], one digest per row (into `out` if given, a
    contiguous int64 tensor of that shape)."""
    flat = rows.contiguous().view(BITS[rows.dtype]).flatten(-2).to(torch.int64)  # [..., KVH*D]
    weights = _weights(flat.shape[-1], rows.device)
    if out is None:
        out = flat.new_empty(flat.shape[:-1])
    if rows.device.type == "cpu":  # one pass and no product tensor: --verify's cost halves
        torch.mv(flat.reshape(-1, flat.shape[-1]), weights, out=out.view(-1))
    else:  # CUDA has no int64 matmul
        torch.sum(flat * weights, dim=-1, out=out)
    return out


class DigestingKV:
    """A KVStore around a request's source-cache view that digests every row it stores:
    two ops a layer (the rows as int64, one product with the weights into the record)."""

    def __init__(self, inner, layers: int, prompt: int, device) -> None:
        self.inner = inner
        self.digests = torch.zeros((layers, prompt, 2), dtype=torch.int64, device=device)

    def append(self, layer: int, start: int, kv: torch.Tensor):
        """Store kv [n, 2, KVH, D] at [start, start+n) and digest it; K/V [start+n, ...]."""
        row_digests(kv, out=self.digests[layer, start:start + kv.shape[0]])  # [n, 2]
        return self.inner.append(layer, start, kv)

    def states(self, layer: int):
        """A linear layer's state of the request (the inner store's views)."""
        return self.inner.states(layer)

    def region(self, layers, tokens) -> torch.Tensor:
        """Digests of a region -> [nl, 2, nt] (a contiguous copy)."""
        held = self.digests[layers[0]:layers[1], tokens[0]:tokens[1]]  # [nl, nt, 2]
        return held.permute(0, 2, 1).clone(memory_format=torch.contiguous_format)


def state_rows(state: torch.Tensor) -> torch.Tensor:
    """Linear layers' states as digest rows: conv windows [ns, C, K-1] -> [ns, 1, 1, C, K-1]
    (a row per layer), recurrent states [ns, Hv, Dk, Dv] -> [ns, Hv, 1, Dk, Dv] (a row per
    value head); their digests are [ns, R, 1], as `first_mismatch` reads them."""
    return state.reshape(state.shape[0], -1, 1, *state.shape[-2:])


def first_mismatch(landed: torch.Tensor, expected: torch.Tensor) -> tuple[int, int] | None:
    """(layer offset, token offset) of the first differing row of [nl, 2, nt], or None."""
    bad = (row_digests(landed) != expected).nonzero()
    if not len(bad):
        return None
    return int(bad[0, 0]), int(bad[0, 2])
