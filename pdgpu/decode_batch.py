"""The decode step over a DecodeCache's rows: padded to few shapes, fed from persistent
buffers, capturable.

A step (`decode_logits`) runs a padded batch laid out bucket by bucket: bucket b's requests
are batch rows [start_b, start_b + rows_b) in row order, rows_b on CUDA the power of two that
holds them (its padding rows are free rows of the bucket, written at position 0 and never
read; on CPU, where a padding row costs what a request does, rows_b is exact), and the batch
has at least MIN_ROWS rows (CPU GEMM kernels pick another reduction for 1..3
rows: the padding keeps a request's bits independent of its batch). Its inputs (tokens,
positions, the caller's order) sit in one persistent buffer that `DecodeBatch.feed` fills
outside the step; inside it nothing is read on the host and no tensor is made from host data,
so it traces whole (torch.compile fullgraph) and is captured as a CUDA graph per layout
(`GraphedStep`): a layout changes only when a bucket is made, resized or freed, a bucket's
padded row count changes, or the state pool grows. Bucket moves and growth happen in
`DecodeBatch()`, before the step. The token choice (`greedy`) is a separate function of the
logits in caller order.

A sliding layer's ring (decode_kv.py) is attended order-free (softmax over a set), masked to
the positions written so far. A linear layer's state is read and written once per layer for
the whole batch (`read_states` / `write_states`) in the cache's state pool; a padding row
reads and writes the pool's scratch slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pdgpu.attention import decode_attention, key_bias
from pdgpu.decode_kv import SequenceKV, rows_for

MIN_ROWS = 8


class _Group(NamedTuple):
    """One bucket's part of a decode step: batch rows [start, start + rows)."""

    kv: tuple[torch.Tensor, ...]  # per full layer [2, capacity, KVH, W, D]: the bucket's rows
    ring: tuple[torch.Tensor, ...]  # per sliding layer [2, capacity, KVH, window, D]
    width: int  # W
    start: int
    rows: int  # its requests, padded to a power of two (<= capacity) if the cache is


class DecodeBatch:
    """One decode step over every request of a cache; `seqs` is the caller's order."""

    def __init__(self, seqs: list[SequenceKV]) -> None:
        cache = seqs[0].cache
        if any(s.cache is not cache or s.bucket is None for s in seqs) or \
                len(set(map(id, seqs))) != cache.count or len(seqs) != cache.count:
            raise ValueError("decode batch: every request of one decode cache, once each")
        for seq in seqs:
            cache.fit(seq, seq.length + 1)
        self.seqs, self.cache = seqs, cache
        self.groups, start, starts = [], 0, {}
        for width in sorted(cache.buckets):
            bucket = cache.buckets[width]
            rows = rows_for(len(bucket.seqs)) if cache.padded else len(bucket.seqs)
            self.groups.append(_Group(tuple(bucket.kv), tuple(bucket.ring), width, start, rows))
            starts[width] = start
            start += self.groups[-1].rows
        self.covered, self.size = start, max(start, MIN_ROWS)
        self.rows = [starts[s.bucket.width] + s.row for s in seqs]  # batch row of each
        cache.buffers(self.size, max(self.size, max(cache.buckets), cache.window or 0))
        # [4, R]: tokens, positions, the caller's order, state slots (hybrids)
        self.inputs = cache.inputs[:, :self.size]
        self.key = (cache.generation, self.size, tuple((g.start, g.rows) for g in self.groups))

    def feed(self, tokens: list[int]) -> None:
        """Write each request's last token, position (and state slot) into the step's
        inputs (one copy; padding rows get token 0 at position 0, and the scratch slot)."""
        host = self.cache.staging[:, :self.size]
        host.zero_()
        rows = torch.tensor(self.rows, dtype=torch.int64)  # [B]
        host[0, rows] = torch.tensor(tokens, dtype=torch.int64)
        host[1, rows] = torch.tensor([s.length for s in self.seqs], dtype=torch.int64)
        host[2, :len(rows)] = rows
        if self.cache.states is not None:
            host[3] = self.cache.scratch
            host[3, rows] = torch.tensor([s.slot for s in self.seqs], dtype=torch.int64)
        self.inputs.copy_(host, non_blocking=host.is_pinned())

    @property
    def order(self) -> torch.Tensor:
        """The batch row of each request, in the caller's order -> [B] (a view)."""
        return self.inputs[2, :len(self.seqs)]

    def masks(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """Per group (once a step): where its rows write and what they see, in the full
        layers (positions [n], key mask [n, 1, 1, W]) and in the rings of the sliding ones
        (positions % window, mask [n, 1, 1, window]; or None)."""
        out, window, columns = [], self.cache.window, self.cache.arange
        for g in self.groups:
            places = positions[g.start:g.start + g.rows]  # [n]
            full = (places, key_bias(places, columns[:g.width], dtype))
            ring = None if window is None else (
                places % window, key_bias(places.clamp(max=window - 1), columns[:window], dtype))
            out.append((full, ring))
        return tuple(out)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               masks: tuple) -> torch.Tensor:
        """q [R, H, D], k/v [R, KVH, D]: store each row's k/v at its position, then each
        group's attention in one call -> [R, H * D]."""
        new, outs = torch.stack((k, v), dim=1), []  # [R, 2, KVH, D]
        ring, index = self.cache.place[layer]
        for g, (full, rung) in zip(self.groups, masks, strict=True):
            rows = slice(g.start, g.start + g.rows)
            kv = g.ring[index] if ring else g.kv[index]  # [2, capacity, KVH, W, D]
            places, bias = rung if ring else full
            kv[:, self.cache.arange[:g.rows], :, places] = new[rows]  # [n, 2, KVH, D]
            outs.append(decode_attention(q[rows], kv[0, :g.rows], kv[1, :g.rows], bias))
        size, heads, head_dim = q.shape
        if size > self.covered:  # rows in no group (the batch's padding): zeros
            outs.append(self.cache.zero.expand(size - self.covered, *outs[0].shape[1:]))
        if len(outs) == 1:
            return outs[0].reshape(size, heads * head_dim)  # one copy: SDPA's layout is G-major
        return torch.cat(outs).view(size, heads * head_dim)

    def read_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear layer `layer`'s state of every row: conv [R, C, K-1], recurrent
        [R, Hv, Dk, Dv] (one gather for the batch)."""
        return self.cache.states.gather(layer, self.inputs[3])

    def write_states(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store each row's new state of linear layer `layer` (one scatter for the batch)."""
        self.cache.states.scatter(layer, self.inputs[3], conv, recurrent)

    def advance(self) -> None:
        """After a step: every request holds one more token."""
        for seq in self.seqs:
            seq.length += 1


def decode_logits(model, batch: DecodeBatch) -> torch.Tensor:
    """The step: a forward over the batch's persistent inputs -> logits [R, V] (padded,
    bucket order). Capturable: see the module docstring."""
    return model.decode_step(batch.inputs[0], batch.inputs[1], batch)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the most likely token of each row [B]."""
    return logits.argmax(dim=-1)


Forward = Callable[[object, DecodeBatch], torch.Tensor]
Pick = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def decode_tokens(model, batch: DecodeBatch, tokens: list[int], pick: Pick = greedy,
                  forward: Forward = decode_logits) -> list[int]:
    """One step: feed each request's last token, get its next token (caller's order).
    `pick`: logits [B, V] in the caller's order -> tokens [B], greedy unless the requests
    sample (sampler.py); `forward` runs the step (decode_logits, or a GraphedStep replaying
    it)."""
    batch.feed(tokens)
    logits = forward(model, batch).index_select(0, batch.order)  # [B, V]
    chosen = pick(logits)  # [B]
    batch.advance()
    return chosen.tolist()
