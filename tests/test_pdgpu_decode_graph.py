"""The capturable decode step: persistent inputs, few layouts, traced whole, replayed on CUDA."""

from __future__ import annotations

import pytest
import torch

from pdgpu.decode_batch import DecodeBatch, decode_logits, decode_tokens
from pdgpu.decode_kv import DecodeCache
from pdgpu.model import build_model
from pdref.models import load_model

TINY = load_model("tiny")


def _cache(model, lengths, seed=0):
    """A padded decode cache (as on CUDA) holding requests of `lengths` tokens of seeded K/V
    (each length draws the same values whatever the others; a hybrid's states too)."""
    gen = torch.Generator().manual_seed(seed)
    cache = DecodeCache.for_model(model, padded=True)
    seqs = [cache.add(_context(model, n, gen.manual_seed(seed + n)).to(cache.device,
                                                                       cache.dtype),
                      _state(model, gen)) for n in lengths]
    return cache, seqs


def _context(model, n, gen=None):
    """Seeded K/V [L, 2, n, KVH, D] of every K/V layer (zeros without a generator)."""
    spec = model.spec
    shape = (len(model.arch.kv_layers), 2, n, spec.kv_heads, spec.head_dim)
    return torch.zeros(shape) if gen is None else torch.randn(shape, generator=gen)


def _state(model, gen):
    """A hybrid's seeded linear-layer state (StatePool.read's pair), or None."""
    state = model.state_shape
    if state is None:
        return None
    return (torch.randn(state.layers, *state.conv, generator=gen),
            torch.randn(state.layers, *state.recurrent, generator=gen))


def _sensitive(device="cpu"):
    """The tiny model with weights large enough that a token depends on its whole context
    (at the presets' init it echoes its input: stale K/V would not show)."""
    model = build_model(TINY, device=device, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(8)
    return model


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
    requests join, leave and cross into a wider bucket (each layout captured once, those of
    a passed generation dropped, the pool given up and taken afresh)."""
    from pdgpu.decode_graph import GraphedStep
    model = _sensitive("cuda")
    eager, keys = _steps(model, decode_logits)
    graphed = GraphedStep()
    replayed, _ = _steps(model, graphed)
    assert replayed == eager
    assert graphed.captures == len(set(keys))


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


def _steps(model, forward):
    """Steps over a padded cache while requests join, leave and cross into a wider bucket:
    (tokens of each step, the batch key of each step). Step 6 has step 0's padded layout
    over the rows the join of step 4 doubled: a layout whose key missed the new rows would
    replay the old ones."""
    cache, seqs = _cache(model, [245, 40, 100])
    tokens, out, keys = [1, 2, 3], [], []
    for i in range(14):
        if i in (2, 4):  # 4 rows then 5: the bucket's rows double, 4 -> 8
            seqs.append(cache.add(_context(model, 20 + i),
                                  _state(model, torch.Generator().manual_seed(i))))
            tokens.append(4 + i)
        if i in (6, 12):  # 4 rows padded to 4 again; at 12 the rows halve
            cache.remove(seqs.pop(1))
            tokens.pop(1)
        batch = DecodeBatch(seqs)  # at 11 the first request crosses into width 512
        keys.append(batch.key)
        tokens = decode_tokens(model, batch, tokens, forward=forward)
        out.append(list(tokens))  # the next step's joins and leaves edit `tokens`
    return out, keys


@pytest.mark.parametrize(("most", "family"), [(1, "dense"), (2, "dense"), (16, "dense"),
                                              (2, "qwen3.5")])
def test_graphed_steps_replay_eagers_tokens_with_few_graphs_held(most, family):
    """Replayed through a captured batch (the CPU stand-in for a graph, which fails a replay
    over a tensor the cache replaced), steps give the eager steps' tokens while the layout
    changes (and a hybrid's state pool doubles); a layout is captured once while it is held,
    at most `most` are held, and one whose generation passed is dropped."""
    from graph_helpers import replay_eagerly

    from pdgpu.decode_graph import GraphedStep
    model = _sensitive() if family == "dense" else build_model(load_model("tiny-qwen3.5"),
                                                               seed=0)
    eager, keys = _steps(model, decode_logits)
    held = []

    def capture(model, batch, pool):
        held.append(len(graphed.graphs) + 1)
        return replay_eagerly(model, batch, pool)
    graphed = GraphedStep(most=most, capture=capture)
    replayed, replayed_keys = _steps(model, graphed)
    assert replayed == eager and replayed_keys == keys
    assert len({k[0] for k in keys}) >= 2  # a generation passed (the rows doubled, a width)
    if most >= len(set(keys)):
        assert graphed.captures == len(set(keys))  # each layout once
    if most == 1:  # a change of layout is a capture
        assert graphed.captures == 1 + sum(a != b for a, b in zip(keys, keys[1:], strict=False))
    assert max(held) <= most + 1 and len(graphed.graphs) <= most


def test_warm_up_leaves_a_hybrids_linear_states_as_they_were():
    """The warm-up before a capture runs the step eagerly (which advances a gated DeltaNet
    state) and puts the batch's states back: a replay then advances them once."""
    from pdgpu.decode_graph import warm_up
    model = build_model(load_model("tiny-qwen3.5"), seed=0)
    cache, seqs = _cache(model, [30, 50])
    batch = DecodeBatch(seqs)
    batch.feed([3, 4])
    before = cache.states.conv.clone(), cache.states.recurrent.clone()
    warm_up(model, batch)
    assert torch.equal(cache.states.conv, before[0])
    assert torch.equal(cache.states.recurrent, before[1])
    with torch.no_grad():
        decode_logits(model, batch)
    assert not torch.equal(cache.states.recurrent, before[1])  # a step does move them
