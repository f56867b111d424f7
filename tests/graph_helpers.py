"""A CPU stand-in for a CUDA graph capture (decode_graph.GraphedStep's `capture`), shared by
the decode-graph and serve tests."""

from __future__ import annotations

from pdgpu.decode_batch import decode_logits
from pdgpu.decode_graph import warm_up


def read_tensors(batch) -> list:
    """Every tensor a step over `batch` reads that the cache may replace: its buffers, its
    state pool's tensors, and per group its bucket's rows and rings as the cache has them
    now (None for a bucket freed since)."""
    cache = batch.cache
    out = [cache.inputs, cache.arange, cache.zero]
    if cache.states is not None:
        out += [cache.states.conv, cache.states.recurrent]
    for g in batch.groups:
        bucket = cache.buckets.get(g.width)
        out += [None] * (len(g.kv) + len(g.ring)) if bucket is None else bucket.kv + bucket.ring
    return out


def replay_eagerly(model, batch, pool):
    """Capture as CUDA does (warm-up steps that leave the state as it was), and replay the
    step over the *captured* batch. A graph reads the addresses it captured: a replay after
    the cache replaced one of those tensors (a layout key that missed the change) would read
    freed memory, so here it fails, naming the tensor."""
    warm_up(model, batch)
    captured = read_tensors(batch)

    def replay():
        now = read_tensors(batch)
        stale = [i for i, (a, b) in enumerate(zip(captured, now, strict=True)) if a is not b]
        assert not stale, f"a replay would read replaced tensors {stale} (read_tensors order)"
        return decode_logits(model, batch)
    return replay, pool
