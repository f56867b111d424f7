"""Export only (`--no-compute`): a known payload written into the source cache instead of
prefill, and checked byte-exact in the decoder's slab once it landed. A hybrid's K/V layers
carry it where their spans do (a sliding layer its window), and its state spans the zeros of
a state slot nothing computed into (a slot is zeroed when taken): the decoder's must hold them.

The value of (layer, token) is `(31 * layer + token) % 251 + 1` over every K/V element: exact
in every float dtype (integers <= 256), different between neighbouring tokens and layers, so
a span landed at the wrong place or a missing one does not pass.
"""

from __future__ import annotations

import torch

from pdgpu.decoder_pool import DecoderPool, Slab
from pdgpu.source_cache import RequestKV
from pdref.intervals import Range


def payload_values(layer: int, tokens: Range, dtype, device) -> torch.Tensor:
    """The payload of one layer over `tokens` -> [1, n, 1, 1] (broadcast over K/V, heads, D)."""
    positions = torch.arange(tokens[0], tokens[1], device=device, dtype=torch.int64)  # [n]
    return ((31 * layer + positions) % 251 + 1).to(dtype).view(1, -1, 1, 1)


def fill_payload(src: RequestKV, layers: Range, tokens: Range) -> None:
    """Write the payload as the request's K/V of layers x tokens (in place, per layer)."""
    index = src.slots[tokens[0]:tokens[1]]  # [n]
    for layer in range(*layers):
        kv = src.kv[layer]  # [2, S, KVH, D]
        values = payload_values(layer, tokens, kv.dtype, kv.device)  # [1, n, 1, 1]
        kv.index_copy_(1, index, values.expand(2, -1, kv.shape[2], kv.shape[3]))


def payload_matches(pool: DecoderPool, slab: Slab, groups, state_slot: int | None) -> bool:
    """Whether the slab holds exactly the payload where the spans land it (`groups`:
    handoff.kv_groups of the life's suffix: K/V layers x tokens), and (a hybrid with linear
    layers) the decoder's `state_slot` holds zeros."""
    for group in groups:
        slots = slab.slots[group.tokens[0] - slab.prefix:group.tokens[1] - slab.prefix]  # [n]
        for layer in range(*group.layers):
            got = pool.kv[layer].index_select(1, slots)  # [2, n, KVH, D]
            want = payload_values(layer, group.tokens, got.dtype, got.device)
            if not bool((got == want).all()):
                return False
    if state_slot is None:
        return True
    return not any(bool(part.any()) for part in pool.states.read(state_slot))
