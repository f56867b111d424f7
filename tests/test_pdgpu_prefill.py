"""pdgpu.prefill: the one prefill step (chunk or layer) and the prefix warm-up of every shell."""

from __future__ import annotations

import attrs
import pytest
import torch

from pdgpu.model import build_model
from pdgpu.prefill import Prefill, warm_prefix
from pdgpu.serve.digest import DigestingKV, row_digests
from pdgpu.source_cache import SourceCache
from pdref.models import load_model
from pdref.plan import plan_chunks

TINY = attrs.evolve(load_model("tiny"), dtype="float32")
MODEL = build_model(TINY, seed=3)


def prefilled(model, tokens: list[int], prefix: int, chunk: int, layer_major: bool):
    """(source cache, request view, Prefill) after the prefix warm-up and every step."""
    cache = SourceCache(model.spec.geometry(16), 16, "cpu", torch.float32, model.state_shape)
    src = cache.open(len(tokens))
    ids = torch.tensor(tokens)
    prefill = Prefill(model, ids, prefix, chunk, src, warm_prefix(model, ids, prefix, chunk, src))
    if layer_major:
        for layer in range(model.num_layers):
            prefill.layer(layer)
    else:
        for step in plan_chunks(len(tokens), prefix, chunk):
            prefill.chunk(step)
    return cache, src, prefill


def _tokens(n: int) -> list[int]:
    return torch.randint(0, TINY.vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.mark.parametrize(("prompt", "prefix", "chunk"), [(70, 16, 24), (40, 0, 64), (32, 32, 8)])
def test_layer_steps_store_the_kv_and_last_state_of_chunk_steps(prompt, prefix, chunk):
    """Layer-major steps leave bit for bit the K/V and last hidden state that chunk-major
    steps leave, whatever the prefix and chunk (an empty suffix keeps the prefix's)."""
    tokens = _tokens(prompt)
    by_chunk, src_c, chunked = prefilled(MODEL, tokens, prefix, chunk, False)
    by_layer, src_l, layered = prefilled(MODEL, tokens, prefix, chunk, True)
    assert torch.equal(by_chunk.kv[:, :, src_c.slots], by_layer.kv[:, :, src_l.slots])
    assert torch.equal(chunked.last, layered.last)


def test_the_prefix_warm_up_is_the_prefill_of_the_prefix():
    """warm_prefix leaves the K/V of [0, prefix) that a prefill of the prefix alone leaves,
    and returns its last position's hidden state; nothing without a prefix."""
    tokens = _tokens(48)
    whole, src, prefill = prefilled(MODEL, tokens[:32], 0, 32, False)
    cache = SourceCache(TINY.geometry(16), 16, "cpu", torch.float32)
    warmed = cache.open(48)
    last = warm_prefix(MODEL, torch.tensor(tokens), 32, 16, warmed)
    assert torch.allclose(cache.kv[:, :, warmed.slots[:32]], whole.kv[:, :, src.slots],
                          atol=1e-6)
    assert torch.allclose(last, prefill.last, atol=1e-5)
    assert warm_prefix(MODEL, torch.tensor(tokens), 0, 16, warmed) is None


def test_a_digesting_store_digests_every_row_a_step_stores():
    """Through a serving producer's DigestingKV, each step's rows are digested as stored:
    the digests equal those of the K/V in the pages."""
    tokens = _tokens(40)
    cache = SourceCache(TINY.geometry(16), 16, "cpu", torch.float32)
    src = cache.open(40)
    kv = DigestingKV(src, TINY.layers, 40, "cpu")
    prefill = Prefill(MODEL, torch.tensor(tokens), 0, 16, kv)
    for layer in range(TINY.layers):
        prefill.layer(layer)
    stored = cache.kv[:, :, src.slots].permute(0, 2, 1, 3, 4)  # [L, prompt, 2, KVH, D]
    assert torch.equal(kv.digests, row_digests(stored))
