"""One request's prefill, step by step: the compute every shell runs (engine.py, the serving
producer, generate.py, the decoder's prefix cache).

A step is a *chunk* (every layer over tokens [a, b)) or, in layer mode, a *layer* (one layer
over every chunk of the suffix, chunk after chunk). Each layer hands its K/V to the `store`
(model.KVStore) as it computes them: the engine's `RequestKV`, a serving producer's
`DigestingKV` around one (which digests each row then: the step's digests). A linear layer
reads and updates the request's state slot through the same store, so chunk after chunk (or
layer mode's chunks of one layer) it carries the state on. The prefix, when there is one, is
warmed first (`warm_prefix`): its K/V, and its state, are in the store before the first step.
"""

from __future__ import annotations

import attrs
import torch

from pdgpu.handoff import handoff_geometry, kv_geometry
from pdgpu.source_cache import SourceCache
from pdref.intervals import Range
from pdref.plan import plan_chunks


def warm_prefix(model, tokens: torch.Tensor, prefix: int, chunk: int, store):
    """Prefill tokens [0, prefix) of `tokens` [>= prefix] in chunks into `store`; the last
    prefix position's hidden state [1, E], or None when the prefix is empty."""
    last = None
    for a, b in plan_chunks(prefix, 0, chunk):
        last = model.prefill_chunk(tokens[a:b], a, store)[-1:]  # [1, E]
    return last


def prefix_kv(model, tokens: list[int] | tuple[int, ...], chunk: int,
              page_tokens: int) -> torch.Tensor:
    """A decoder's prefix cache: the K/V [L, 2, prefix, KVH, D] of prefix `tokens`, warmed
    as the producers warm theirs (in a scratch cache of its own)."""
    geometry = kv_geometry(handoff_geometry(model.spec, page_tokens))  # K/V layers only
    dtype, device = model.model.embed_tokens.weight.dtype, model.inv_freq.device
    cache = SourceCache(geometry, max(1, geometry.pages_for(len(tokens))), device, dtype,
                        model.state_shape)
    kv = cache.open(max(1, len(tokens)))
    ids = torch.tensor(tokens, dtype=torch.int64, device=device)  # [prefix]
    warm_prefix(model, ids, len(tokens), chunk, kv)
    return kv.kv.index_select(2, kv.slots[:len(tokens)])


@attrs.define
class Prefill:
    """The prefill of one request's suffix [prefix, prompt) of `tokens` [prompt] into
    `store`. `last` is the hidden state [1, E] of the last position computed through every
    layer (the prefix's at first, the prompt's once every step ran)."""

    model: object  # model.Transformer
    tokens: torch.Tensor  # [prompt] on the model's device
    prefix: int
    chunk_tokens: int
    store: object  # model.KVStore
    last: torch.Tensor | None = None  # [1, E]
    by_chunk: list | None = None  # layer mode: the hidden states [n_i, E] of each chunk

    def chunk(self, tokens: Range) -> None:
        """Every layer over positions [a, b) (the chunks in order)."""
        a, b = tokens
        if b > a:
            self.last = self.model.prefill_chunk(self.tokens[a:b], a, self.store)[-1:]

    def layer(self, layer: int) -> None:
        """Layer `layer` over every chunk of the suffix (the layers in order)."""
        chunks = plan_chunks(len(self.tokens), self.prefix, self.chunk_tokens)
        if not chunks:
            return
        if self.by_chunk is None:
            self.by_chunk = [self.model.embed(self.tokens[a:b]) for a, b in chunks]
        self.by_chunk = [self.model.run_layer(layer, h, a, self.store)  # [n_i, E]
                         for h, (a, _) in zip(self.by_chunk, chunks, strict=True)]
        self.last = self.by_chunk[-1][-1:]  # [1, E] once the last layer ran
