"""`pdgpu generate`'s reference: one request, one process, no handoff, greedy.

It computes exactly what `pdgpu serve` computes, the same way, so a served request's output
tokens must equal these: the prompt is prefilled in the same chunks (the prefix's own chunks,
then the suffix's aligned at the prefix), the first token comes from the last prompt position,
and every later token from `Transformer.decode_step` (batch-invariant by construction).
"""

from __future__ import annotations

import torch

from pdgpu.decode_kv import DecodeBatch, DecodeCache, decode_tokens
from pdgpu.model import Transformer
from pdgpu.source_cache import SourceCache
from pdref.plan import plan_chunks


def prefill_chunks(prompt: int, prefix: int, chunk: int) -> list[tuple[int, int]]:
    """The prefill chunks of a prompt whose first `prefix` tokens are a shared prefix."""
    return plan_chunks(prefix, 0, chunk) + plan_chunks(prompt, prefix, chunk)


def first_token(model: Transformer, hidden: torch.Tensor) -> int:
    """Greedy token from the last prompt position's hidden state [1, E]."""
    return int(model.logits(hidden).argmax(dim=-1)[0])


@torch.no_grad()
def generate(model: Transformer, tokens: list[int], output_tokens: int, chunk: int = 64,
             prefix: int = 0, page_tokens: int = 16, eos: int | None = None) -> list[int]:
    """The `output_tokens` greedy tokens after `tokens` (the first one from prefill), or
    fewer, ending with `eos` when that token comes first."""
    if output_tokens < 1:
        raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
    device = model.inv_freq.device
    geometry = model.spec.geometry(page_tokens)
    dtype = model.model.embed_tokens.weight.dtype
    cache = SourceCache(geometry, geometry.pages_for(len(tokens)), device, dtype,
                        model.state_shape)
    kv = cache.open(len(tokens))
    ids = torch.tensor(tokens, dtype=torch.int64, device=device)  # [prompt]
    hidden = None
    for a, b in prefill_chunks(len(tokens), prefix, chunk):
        hidden = model.prefill_chunk(ids[a:b], a, kv)[-1:]  # [1, E]
    out = [first_token(model, hidden)]
    context = kv.kv.index_select(2, kv.slots)  # [L, 2, prompt, KVH, D]
    seq = DecodeCache.for_model(model).add(context, kv.read_state())
    while len(out) < output_tokens and out[-1] != eos:
        out.append(decode_tokens(model, DecodeBatch([seq]), [out[-1]])[0])
    return out
