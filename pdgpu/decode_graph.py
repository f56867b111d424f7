"""The decode step captured as a CUDA graph per batch layout, and replayed.

A step (decode_batch.decode_logits) launches a few hundred kernels of a few microseconds of work
each at small batches: on a GPU the launches, not the math, set its time. Captured once per
layout (DecodeBatch.key: which buckets, how many padded rows each, which buffers), a step is
one graph launch. The inputs are the cache's persistent buffer, filled by `DecodeBatch.feed`
before the replay; the logits come back in the graph's own output tensor (valid until the
next replay).

Layouts change as requests join, leave or cross a width (a serving loop's batch does all
three). A layout whose tensors were freed (a bucket made, resized or emptied, a buffer
grown: the key's generation moved on) is dropped with its graph before anything is
captured or replayed, so no graph ever reads freed memory; within one generation a bucket's
padded rows take few values (its capacity's powers of two above a quarter of it, decode_kv),
and at most `most` graphs are kept, the least recently replayed dropped first: the graphs
hold at most `most` logits outputs [R, V] plus one step's working memory (they share one
memory pool, and replay one at a time).

`--cuda-graphs {auto,on,off}` of `pdgpu serve` and `pdgpu generate` picks the step
(`decode_forward`): auto replays graphs where the decoder is on CUDA, on refuses a CPU one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from pdgpu.decode_batch import DecodeBatch, Forward, decode_logits

WARMUP_STEPS = 2  # eager runs before a capture (lazy inits, autotuning)
MOST_GRAPHS = 16  # graphs kept at once (each holds its logits [R, V])
GRAPH_MODES = ("auto", "on", "off")

Replay = Callable[[], torch.Tensor]  # runs the captured step -> its logits [R, V]
Capture = Callable[[object, DecodeBatch, object], tuple[Replay, object]]


def graph_problem(mode: str, device) -> str | None:
    """Why `--cuda-graphs mode` cannot run a decoder on `device` (one line), or None."""
    if mode not in GRAPH_MODES:
        return f"cuda-graphs: must be one of {', '.join(GRAPH_MODES)}, got {mode!r}"
    if mode == "on" and torch.device(device).type != "cuda":
        return f"cuda-graphs: on needs the decoder on a CUDA device, got {device}"
    return None


def uses_graphs(mode: str, device) -> bool:
    """Whether a decoder on `device` replays graphs under `--cuda-graphs mode` (checked)."""
    problem = graph_problem(mode, device)
    if problem is not None:
        raise ValueError(problem)
    return mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")


def decode_forward(mode: str, device) -> Forward:
    """The decode step a decoder on `device` runs: a GraphedStep, or the eager step."""
    return GraphedStep() if uses_graphs(mode, device) else decode_logits


class GraphedStep:
    """A `forward` for decode_batch.decode_tokens: replays the batch layout's captured step,
    capturing it first when the layout is new (`capture`: CUDA graphs; tests give a CPU
    stand-in that replays the captured batch eagerly)."""

    def __init__(self, most: int = MOST_GRAPHS, capture: Capture | None = None) -> None:
        if most < 1:
            raise ValueError(f"graphed step: most must be >= 1, got {most}")
        self.most, self.capture = most, capture or capture_cuda
        self.graphs: OrderedDict[tuple, Replay] = OrderedDict()  # layout -> its replay
        self.pool = None  # the graphs' shared memory pool, while one holds it
        self.captures = 0  # layouts captured so far (a dropped one captured again counts)
        self.dropped = 0  # graphs dropped: their layout's tensors freed, or beyond `most`

    def __call__(self, model, batch: DecodeBatch) -> torch.Tensor:
        """Logits [R, V] of the step over the batch's fed inputs."""
        if batch.key not in self.graphs:
            self._drop(lambda key: key[0] != batch.key[0])  # another generation: freed
            if not self.graphs:
                self.pool = None  # no graph holds it any more: a new capture makes its own
            self.graphs[batch.key], self.pool = self.capture(model, batch, self.pool)
            self.captures += 1
            while len(self.graphs) > self.most:
                self.graphs.popitem(last=False)
                self.dropped += 1
        self.graphs.move_to_end(batch.key)
        return self.graphs[batch.key]()

    def _drop(self, stale) -> None:
        for key in [k for k in self.graphs if stale(k)]:
            del self.graphs[key]
            self.dropped += 1


def warm_up(model, batch: DecodeBatch, steps: int = WARMUP_STEPS) -> None:
    """Run the step `steps` times eagerly and leave the state as it was: the K/V rows they
    write are the ones the replay writes again (same tokens, same positions), and a hybrid's
    linear-layer states, which a step advances, are put back."""
    states = batch.cache.states
    if states is not None:  # [NL, B, ...] of the batch's slots (and the padding's scratch)
        slots = batch.inputs[3]
        saved = states.conv.index_select(1, slots), states.recurrent.index_select(1, slots)
    with torch.no_grad():
        for _ in range(steps):
            decode_logits(model, batch)
    if states is not None:
        states.conv.index_copy_(1, slots, saved[0])
        states.recurrent.index_copy_(1, slots, saved[1])


def capture_cuda(model, batch: DecodeBatch, pool) -> tuple[Replay, object]:
    """Warm up on a side stream, then capture the step into `pool` (None: a new one);
    (its replay, the pool)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm_up(model, batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the decoder's other threads (a lane's receiving thread, NCCL's) may
    # allocate or synchronize meanwhile; in the default global mode that fails the capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), \
            torch.no_grad():
        logits = decode_logits(model, batch)  # [R, V], the graph's own memory

    def replay() -> torch.Tensor:
        graph.replay()
        return logits
    return replay, graph.pool()
