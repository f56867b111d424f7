"""`pdgpu generate`'s reference: one request, one process, no handoff.

It computes exactly what `pdgpu serve` computes, the same way, so a served request's output
tokens must equal these: the prompt is prefilled in the same chunks (the prefix's own chunks,
then the suffix's aligned at the prefix), the first token comes from the last prompt position,
and every later token from `Transformer.decode_step` (batch-invariant by construction), each
drawn by the same sampler (greedy, or the request's sampling options with its seed: a token
depends on the seed and its position only, not on the batch; sampler.py).
"""

from __future__ import annotations

import torch

from pdgpu.decode_batch import DecodeBatch, Forward, decode_logits, decode_tokens, greedy
from pdgpu.decode_kv import DecodeCache
from pdgpu.handoff import handoff_geometry, kv_geometry
from pdgpu.model import Transformer
from pdgpu.prefill import Prefill, warm_prefix
from pdgpu.sampler import Sampler, Step
from pdgpu.sampling import GREEDY, Sampling
from pdgpu.source_cache import SourceCache, token_slots
from pdgpu.source_prefix import SourcePrefix, load_hit
from pdref.plan import plan_chunks


def prefill_chunks(prompt: int, prefix: int, chunk: int) -> list[tuple[int, int]]:
    """The prefill chunks of a prompt whose first `prefix` tokens are a shared prefix."""
    return plan_chunks(prefix, 0, chunk) + plan_chunks(prompt, prefix, chunk)


def first_token(model: Transformer, hidden: torch.Tensor, pick=greedy) -> int:
    """The token after the last prompt position's hidden state [1, E] (`pick`: logits [1, V]
    -> [1])."""
    return int(pick(model.logits(hidden))[0])


def stop_tokens(sampling: Sampling, eos: int | None, stop=frozenset()) -> frozenset[int]:
    """The tokens that end a request: its stop tokens and, unless it ignores it, `eos`."""
    return frozenset(stop) | (frozenset() if eos is None or sampling.ignore_eos else {eos})


def step_at(sampling: Sampling, position: int, stops: frozenset[int], slot: int = 0) -> Step:
    """The draw of output token `position`: stop tokens banned before `min_tokens`."""
    ban = tuple(sorted(stops)) if position < sampling.min_tokens else ()
    return Step(sampling, position, ban, slot)


@torch.no_grad()
def generate(model: Transformer, tokens: list[int], output_tokens: int, chunk: int = 64,
             prefix: int = 0, page_tokens: int = 16, eos: int | None = None,
             sampling: Sampling = GREEDY, forward: Forward = decode_logits) -> list[int]:
    """The `output_tokens` tokens after `tokens` (the first one from prefill), or fewer,
    ending with `eos` when that token comes first (unless `sampling` ignores it); each
    decode step run by `forward` (eager, or a decode_graph.GraphedStep)."""
    if output_tokens < 1:
        raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
    device = model.inv_freq.device
    geometry = kv_geometry(handoff_geometry(model.spec, page_tokens))  # K/V layers only
    dtype = model.model.embed_tokens.weight.dtype
    cache = SourceCache(geometry, geometry.pages_for(len(tokens)), device, dtype,
                        model.state_shape)
    kv = cache.open(len(tokens))
    ids = torch.tensor(tokens, dtype=torch.int64, device=device)  # [prompt]
    prefill = Prefill(model, ids, prefix, chunk, kv, warm_prefix(model, ids, prefix, chunk, kv))
    for step in plan_chunks(len(tokens), prefix, chunk):
        prefill.chunk(step)
    return _decode(model, kv, prefill.last, tokens, output_tokens, eos, sampling, forward)


def _decode(model: Transformer, kv, last: torch.Tensor, tokens: list[int], output_tokens: int,
            eos: int | None, sampling: Sampling, forward: Forward = decode_logits) -> list[int]:
    """The output tokens after a prefill that left `kv` (a RequestKV of the prompt) and the
    last prompt position's hidden state `last` [1, E]."""
    device = model.inv_freq.device
    sampler, stops = Sampler(model.spec.vocab, device), stop_tokens(sampling, eos)
    slot = sampler.open(sampling, tokens)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        return sampler.pick(logits, [step_at(sampling, len(out), stops, slot)])
    out: list[int] = []
    out.append(first_token(model, last, pick))
    context = kv.kv.index_select(2, kv.slots)  # [L, 2, prompt, KVH, D]
    seq = DecodeCache.for_model(model).add(context, kv.read_state())
    while len(out) < output_tokens and out[-1] not in stops:
        out.append(decode_tokens(model, DecodeBatch([seq]), [out[-1]], pick, forward)[0])
    return out


@torch.no_grad()
def generate_cached(model: Transformer, prompts: list[list[int]], output_tokens: list[int],
                    chunk: int, page_tokens: int, cache_pages: int, eos: int | None = None,
                    sampling: Sampling = GREEDY, forward: Forward = decode_logits
                    ) -> tuple[list[list[int]], int]:
    """`generate` of each prompt in turn through one producer's automatic prefix cache of
    `cache_pages` pages (source_prefix.py: the serving producer's), `output_tokens` each
    (or fewer, at `eos`): (each prompt's output
    tokens, which the cache must not change, and the prompt tokens computed in all)."""
    device = model.inv_freq.device
    geometry = kv_geometry(handoff_geometry(model.spec, page_tokens))
    longest = max(geometry.pages_for(len(p)) for p in prompts)
    source = SourceCache(geometry, cache_pages + longest, device,
                         model.model.embed_tokens.weight.dtype, model.state_shape)
    cache = SourcePrefix(source, cache_pages, chunk)
    outputs, computed = [], 0
    for tokens, out in zip(prompts, output_tokens, strict=True):
        held, _ = cache.open(len(tokens), cache.lookup(tokens))
        slot = None if source.states is None else source.states.take()  # zeroed
        kv = source.view(token_slots(held.pages, page_tokens, len(tokens), device), held.pages,
                         slot)
        load_hit(kv, held.skip)
        if cache.snapshot(held) is not None:  # a hybrid's state at the hit's end
            source.states.write(slot, *cache.snapshot(held))
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)  # [prompt]
        prefill = Prefill(model, ids, held.skip, chunk, kv)
        for step in plan_chunks(len(tokens), held.skip, chunk):
            prefill.chunk(step)
            cache.took_state(held, step[1], kv.read_state)
        computed += len(tokens) - held.skip
        cache.keep(tokens, held, held.skip)
        cache.confirm(held, recorded=True)
        outputs.append(_decode(model, kv, prefill.last, tokens, out, eos, sampling, forward))
        cache.release(held)
        if slot is not None:
            source.states.give_back(slot)
    return outputs, computed
