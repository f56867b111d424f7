"""A CPU stand-in for a CUDA graph capture (decode_graph.GraphedStep's `capture`), shared by
the decode-graph and serve tests."""

from __future__ import annotations

from pdgpu.decode_batch import decode_logits
from pdgpu.decode_graph import warm_up


def replay_eagerly(model, batch, pool):
    """Capture as CUDA does (warm-up steps that leave the state as it was), and replay the
    step over the *captured* batch: its buffers and bucket tensors, as a graph reads its
    captured addresses, whatever batch the caller made since. A layout key that missed a
    tensor change would replay stale tensors here as on a GPU, and the tokens would differ."""
    warm_up(model, batch)
    return (lambda: decode_logits(model, batch)), pool
