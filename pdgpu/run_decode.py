"""The decoder side of `pdgpu run` after admission: decode a request from what crossed.

A request admitted with `output_tokens > 1` is decoded greedily, one request at a time, from
what the handoff delivered and nothing else: its suffix K/V from its decoder slab (a sliding
layer's slab holds only its window: `DecodeCache.add` reads only that into the ring), a
hybrid's state from the decoder state slot its state spans landed in, and the K/V of its
prefix from the decoder's own prefix cache (computed once per prefix, as a serving decoder
computes its own). The tokens equal `pdgpu generate`'s: the same decode step over the same
K/V and state (tests/test_pdgpu_hybrid.py).
"""

from __future__ import annotations

import torch

from pdgpu.decode_batch import DecodeBatch, decode_tokens
from pdgpu.decode_kv import DecodeCache
from pdgpu.prefill import prefix_kv


class RunDecoder:
    """Decodes admitted requests on the model's device (the context is moved there)."""

    def __init__(self, model, page_tokens: int, chunk: int) -> None:
        self.model, self.page_tokens, self.chunk = model, page_tokens, chunk
        self.device = model.inv_freq.device
        self.prefixes: dict[tuple[int, ...], torch.Tensor] = {}  # tokens -> [L, 2, p, KVH, D]

    def tokens(self, prompt: tuple[int, ...], prefix: int, suffix_kv: torch.Tensor, state,
               first: int, count: int) -> tuple[int, ...]:
        """`count` greedy tokens from `first` on, for a request of `prompt` whose suffix K/V
        [L, 2, prompt - prefix, KVH, D] and state (StatePool.read's pair or None) crossed."""
        context = torch.cat((self._prefix_kv(prompt[:prefix]), suffix_kv.to(self.device)), 2)
        if state is not None:
            state = tuple(s.to(self.device) for s in state)
        cache = DecodeCache.for_model(self.model)
        seq = cache.add(context, state)  # [L, 2, prompt, KVH, D]: the window only is read
        out = [first]
        while len(out) < count:
            out += decode_tokens(self.model, DecodeBatch([seq]), [out[-1]])
        cache.remove(seq)
        return tuple(out)

    def _prefix_kv(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """The decoder's prefix cache: K/V [L, 2, prefix, KVH, D] of `tokens`."""
        if tokens not in self.prefixes:
            self.prefixes[tokens] = prefix_kv(self.model, tokens, self.chunk, self.page_tokens)
        return self.prefixes[tokens]
