"""The capturable decode step: persistent inputs, few layouts, traced whole, replayed on CUDA."""

from __future__ import annotations

import pytest
import torch

from pdgpu.decode_kv import DecodeBatch, DecodeCache, decode_logits, decode_tokens
from pdgpu.model import build_model
from pdref.models import load_model

TINY = load_model("tiny")


def _cache(model, lengths, seed=0):
    """A padded decode cache (as on CUDA) holding requests of `lengths` tokens of seeded K/V
    (each length draws the same values whatever the others)."""
    gen = torch.Generator().manual_seed(seed)
    cache = DecodeCache.for_model(model, padded=True)
    spec = model.spec
    seqs = [cache.add(torch.randn(spec.layers, 2, n, spec.kv_heads, spec.head_dim,
                                  generator=gen.manual_seed(seed + n))
                      .to(cache.device, cache.dtype)) for n in lengths]
    return cache, seqs


def test_the_step_traces_whole_with_no_graph_break():
    """torch.compile(fullgraph=True) traces the step (0 graph breaks) and gives eager's
    logits, over two buckets and padding rows."""
    model = build_model(TINY, seed=0)
    _, seqs = _cache(model, [20, 300, 40])
    batch = DecodeBatch(seqs)
    batch.feed([5, 6, 7])
    with torch.no_grad():
        eager = decode_logits(model, batch)
        explained = torch._dynamo.explain(decode_logits)(model, batch)
        compiled = torch.compile(decode_logits, fullgraph=True, backend="eager")(model, batch)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert torch.equal(compiled, eager)
    torch._dynamo.reset()


def test_steps_of_one_layout_reuse_the_same_buffers_and_key():
    """Steps over the same requests (growing by a token each) keep one layout and one input
    buffer; a request in a new width changes the layout."""
    model = build_model(TINY, seed=0)
    cache, seqs = _cache(model, [20, 30])
    first = DecodeBatch(seqs)
    tokens = decode_tokens(model, first, [1, 2])
    second = DecodeBatch(seqs)
    assert second.key == first.key
    assert second.inputs.data_ptr() == first.inputs.data_ptr()
    decode_tokens(model, second, tokens)
    seqs.append(cache.add(torch.zeros(TINY.layers, 2, 700, TINY.kv_heads, TINY.head_dim)))
    assert DecodeBatch(seqs).key != first.key


def test_the_padded_layout_takes_few_shapes():
    """Batches of 1..40 requests in one bucket take the shapes of powers of two (min 8)."""
    model = build_model(TINY, seed=0)
    cache, seqs = _cache(model, [])
    sizes = set()
    for _ in range(40):
        seqs.append(cache.add(torch.zeros(TINY.layers, 2, 10, TINY.kv_heads, TINY.head_dim)))
        sizes.add(DecodeBatch(seqs).size)
    assert sizes == {8, 16, 32, 64}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_gives_the_eager_steps_tokens():
    """On CUDA, steps replayed from captured graphs give the eager steps' tokens, while
    requests join, leave and cross into a wider bucket (new layouts captured on the way)."""
    from pdgpu.decode_graph import GraphedStep
    model = build_model(TINY, device="cuda", seed=0)
    graphed = GraphedStep()
    runs = {}
    for name, step in (("eager", decode_logits), ("graph", graphed)):
        cache, seqs = _cache(model, [250, 40, 100])
        tokens, out = [1, 2, 3], []
        for i in range(12):
            if i == 4:
                seqs.append(cache.add(torch.zeros(TINY.layers, 2, 60, TINY.kv_heads,
                                                  TINY.head_dim, device="cuda")))
                tokens.append(4)
            if i == 8:
                cache.remove(seqs.pop(1))
                tokens.pop(1)
            tokens = decode_tokens(model, DecodeBatch(seqs), tokens, forward=step)
            out.append(tokens)
        runs[name] = out
    assert runs["graph"] == runs["eager"]
    assert 2 <= graphed.captures <= 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_decode_step_is_batch_invariant(dtype):
    """On CUDA (padded groups, as served): a request's logits are bit-identical alone and in
    a batch of requests in other buckets. If cuBLAS picks another algorithm for another
    batch size, this fails: the README's token-parity statement rests on it."""
    import attrs
    model = build_model(attrs.evolve(TINY, dtype=dtype), device="cuda", seed=0)
    lengths, tokens = [20, 300, 40, 700, 90], [5, 6, 7, 8, 9]

    def logits(indices):
        _, seqs = _cache(model, [lengths[i] for i in indices])
        batch = DecodeBatch(seqs)
        batch.feed([tokens[i] for i in indices])
        with torch.no_grad():
            return decode_logits(model, batch)[batch.order]

    together = logits([0, 1, 2, 3, 4])
    for place in range(5):
        assert torch.equal(logits([place])[0], together[place]), place
