"""The decode step captured as a CUDA graph per batch layout, and replayed.

A step (decode_kv.decode_logits) launches a few hundred kernels of a few microseconds of work
each at small batches: on a GPU the launches, not the math, set its time. Captured once per
layout (DecodeBatch.key: which buckets, how many padded rows each, which buffers), a step is
one graph launch. The inputs are the cache's persistent buffer, filled by `DecodeBatch.feed`
before the replay; the logits come back in the graph's own output tensor (valid until the
next replay). A layout whose tensors were freed (a bucket resized or emptied) is dropped
with its graph before any replay, so no graph ever reads freed memory; every graph shares
one memory pool.
"""

from __future__ import annotations

import torch

from pdgpu.decode_kv import DecodeBatch, decode_logits

WARMUP_STEPS = 2  # eager runs on a side stream before a capture (lazy inits, autotuning)


class GraphedStep:
    """A `step` for decode_kv.decode_tokens: replays the batch layout's CUDA graph,
    capturing it first when the layout is new."""

    def __init__(self) -> None:
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.captures = 0

    def __call__(self, model, batch: DecodeBatch) -> torch.Tensor:
        """Logits [R, V] of the step over the batch's fed inputs."""
        if batch.key not in self.graphs:
            generation = batch.key[0]
            self.graphs = {k: g for k, g in self.graphs.items() if k[0] == generation}
            self.graphs[batch.key] = self._capture(model, batch)
        graph, logits = self.graphs[batch.key]
        graph.replay()
        return logits

    def _capture(self, model, batch: DecodeBatch):
        """Warm up on a side stream, then capture. The warm-up steps write the same K/V rows
        the replay then writes again (same tokens, same positions): no state moves."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(WARMUP_STEPS):
                decode_logits(model, batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.no_grad():
            logits = decode_logits(model, batch)  # [R, V], the graph's own memory
        self.pool = graph.pool()
        self.captures += 1
        return graph, logits
