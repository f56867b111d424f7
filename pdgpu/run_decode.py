"""The decoder side of `pdgpu run` after admission: decode a request from what crossed.

A request admitted with `output_tokens > 1` is decoded greedily, one request at a time, from
what the handoff delivered and nothing else: its suffix K/V in the slab pages of the decoder
pool (a sliding layer's slab holds only its window: only that is read into the ring), a
hybrid's state in the decoder state slot its state spans landed in, and the K/V of its
prefix from the decoder's own prefix cache (computed once per prefix, as a serving decoder
computes its own). Admission is the serving decoder's (`DecodeCache.add_paged`): the prefix
and the slab are gathered once each straight into the request's decode row, and the landed
state is read where it landed (the decode cache shares the pool's state slots, lent for the
decode: the engine's `release` gives the slot back). With the pool on another device than
the model (`--decoder-device`), the slab is gathered on the pool's device and copied across
once, and the state copied once into the decode cache's own slots.
The tokens equal `pdgpu generate`'s: the same decode step over the same K/V and state
(tests/test_pdgpu_hybrid.py); the bytes admission copies: tests/test_pdgpu_run_decode.py.
"""

from __future__ import annotations

import torch

from pdgpu.decode_batch import DecodeBatch, decode_tokens
from pdgpu.decode_kv import DecodeCache, SequenceKV
from pdgpu.decoder_pool import DecoderPool, Slab
from pdgpu.prefill import prefix_kv

Part = tuple[torch.Tensor, torch.Tensor]  # K/V [L, 2, S, KVH, D], slots [n] of its tokens


class RunDecoder:
    """Decodes admitted requests of one run on the model's device, from its decoder pool."""

    def __init__(self, model, pool: DecoderPool, page_tokens: int, chunk: int) -> None:
        self.model, self.pool, self.page_tokens, self.chunk = model, pool, page_tokens, chunk
        self.device = model.inv_freq.device
        # the landed states where they landed, when the model can read them there
        self.lent = pool.states is not None and pool.kv.device == self.device
        self.cache = DecodeCache.for_model(model, states=pool.states if self.lent else None)
        self.prefixes: dict[tuple[int, ...], Part] = {}  # prefix tokens -> its part

    def tokens(self, prompt: tuple[int, ...], prefix: int, slab: Slab, state_slot: int | None,
               first: int, count: int) -> tuple[int, ...]:
        """`count` greedy tokens from `first` on, for a request of `prompt` whose suffix K/V
        landed in `slab` and whose state (a hybrid's) in slot `state_slot` of the pool."""
        seq = self.admit(prompt[:prefix], slab, state_slot)
        try:
            out = [first]
            while len(out) < count:
                out += decode_tokens(self.model, DecodeBatch([seq]), [out[-1]])
        finally:
            if self.lent:
                seq.slot = None  # the pool's: the engine's release gives it back
            self.cache.remove(seq)
        return tuple(out)

    def admit(self, prefix: tuple[int, ...], slab: Slab, state_slot: int | None) -> SequenceKV:
        """The request into decode memory: its prefix's K/V and its slab's, each gathered
        once into its row; its state lent (or copied once from another device)."""
        parts = (self._prefix(prefix), (self.pool.kv, slab.slots))
        if state_slot is not None and not self.lent:
            states = self.pool.states
            state_slot = self.cache.own((states.conv[:, state_slot],
                                         states.recurrent[:, state_slot]))
        return self.cache.add_paged(parts, state_slot)

    def _prefix(self, tokens: tuple[int, ...]) -> Part:
        """The decoder's prefix cache: K/V [L, 2, prefix, KVH, D] of `tokens`, and its
        slots [prefix] (every row, in order)."""
        if tokens not in self.prefixes:
            kv = prefix_kv(self.model, tokens, self.chunk, self.page_tokens)
            self.prefixes[tokens] = kv, torch.arange(len(tokens), device=kv.device)
        return self.prefixes[tokens]
