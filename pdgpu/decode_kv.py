"""The K/V requests decode with, kept in rows of equal width so a batch attends in few calls,
and the decode step over them: padded to few shapes, fed from persistent buffers, capturable.

At admission a request's context (prefix cache + the slab its spans landed in, or a single-
process prefill) is copied once into a row of a `DecodeCache` bucket: every row of a bucket
is `width` tokens wide (a power of two, at least MIN_WIDTH), so the bucket's K/V for one layer
is one tensor [rows, KVH, width, D] and its requests attend in one call, however ragged their
lengths (attention.decode_attention). Each step appends one K/V row per request in place; a
request about to outgrow its row moves once to the next bucket (a copy of its K/V, once per
doubling of its length); a request that ends leaves its bucket's last row in its place, so a
bucket's rows [0, count) are always its requests. A bucket's rows double when full and halve
once a quarter or less is used, and an empty bucket is freed: the memory held stays within
four rows per running request of its width (tests/test_pdgpu_decode_kv.py).

A step (`decode_logits`) runs a padded batch laid out bucket by bucket: bucket b's requests
are batch rows [start_b, start_b + rows_b) in row order, rows_b on CUDA the power of two that
holds them (its padding rows are free rows of the bucket, written at position 0 and never
read; on CPU, where a padding row costs what a request does, rows_b is exact), and the batch
has at least MIN_ROWS rows (CPU GEMM kernels pick another reduction for 1..3
rows: the padding keeps a request's bits independent of its batch). Its inputs (tokens,
positions, the caller's order) sit in one persistent buffer that `DecodeBatch.feed` fills
outside the step; inside it nothing is read on the host and no tensor is made from host data,
so it traces whole (torch.compile fullgraph) and is captured as a CUDA graph per layout
(`GraphedStep`): a layout changes only when a bucket is made, resized or freed, or a
bucket's padded row count changes. Bucket moves and growth happen in `DecodeBatch()`, before
the step. The token choice (`greedy`) is a separate function of the logits in caller order.

Hybrids. Sliding-window layers (Gemma 3) keep no growing row: each bucket row also has a
*ring* of `window` positions per sliding layer (`Bucket.ring`), position p at p % window, so
a request's memory for those layers stays the same at any context; attention over a ring is
order-free (softmax over a set), masked to the positions written so far. Linear layers
(Qwen3.5's gated DeltaNet) keep their state in a slot of the cache's StatePool, which a step
reads and writes once per layer for the whole batch (`read_states` / `write_states`); a
padding row reads and writes the pool's scratch slot, taken when the cache is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pdgpu.attention import decode_attention, key_bias
from pdgpu.state_pool import StatePool, StateShape

MIN_WIDTH = 256
MIN_ROWS = 8


def width_for(tokens: int) -> int:
    """The row width that holds `tokens` keys: a power of two, at least MIN_WIDTH."""
    return max(MIN_WIDTH, 1 << (tokens - 1).bit_length())


def rows_for(count: int) -> int:
    """The power of two that holds `count` rows (at least 1)."""
    return 1 << max(count - 1, 0).bit_length()


class SequenceKV:
    """One request in a DecodeCache: its bucket, its row there and its length so far."""

    def __init__(self, cache: DecodeCache, length: int) -> None:
        self.cache, self.length = cache, length
        self.bucket: Bucket | None = None
        self.row = 0
        self.slot: int | None = None  # its linear-layer state's slot (hybrids)


class Bucket:
    """Rows of one width: kv [Lf, 2, capacity, KVH, width, D] of the full layers, ring
    [Ls, 2, capacity, KVH, window, D] of the sliding ones (or None); row i holds seqs[i]."""

    def __init__(self, cache: DecodeCache, width: int) -> None:
        self.cache, self.width = cache, width
        self.seqs: list[SequenceKV] = []
        self.kv = cache.rows(width, 1)
        self.ring = cache.ring_rows(1)

    def add(self, seq: SequenceKV) -> int:
        """Give `seq` the next row (the rows double when full); its row index."""
        if len(self.seqs) == self.kv.shape[2]:
            self._resize(2 * len(self.seqs))
        seq.bucket, seq.row = self, len(self.seqs)
        self.seqs.append(seq)
        return seq.row

    def remove_row(self, row: int) -> None:
        """Free `row`; the last row moves into its place; the rows halve (repeatedly) while
        a quarter or less of them is used."""
        last = self.seqs.pop()
        if row != len(self.seqs):
            self.kv[:, :, row, :, :last.length] = self.kv[:, :, last.row, :, :last.length]
            if self.ring is not None:
                self.ring[:, :, row] = self.ring[:, :, last.row]
            self.seqs[row], last.row = last, row
        if self.seqs and len(self.seqs) <= self.kv.shape[2] // 4:
            self._resize(2 * rows_for(len(self.seqs)))

    def _resize(self, capacity: int) -> None:
        """New rows [.., capacity, ..] holding the used ones (a new layout for the step)."""
        resized = self.cache.rows(self.width, capacity)
        used = len(self.seqs)
        resized[:, :, :used] = self.kv[:, :, :used]
        self.kv = resized
        if self.ring is not None:
            ring = self.cache.ring_rows(capacity)
            ring[:, :, :used] = self.ring[:, :, :used]
            self.ring = ring


class DecodeCache:
    """Every running request's K/V on one device, in buckets by row width, and the decode
    step's persistent buffers."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, device, dtype,
                 windows: tuple[int | None, ...] | None = None,
                 state: StateShape | None = None, padded: bool | None = None) -> None:
        windows = windows or (None,) * layers  # per K/V layer: its window, None if full
        self.full = [i for i, w in enumerate(windows) if w is None]
        self.sliding = [i for i, w in enumerate(windows) if w is not None]
        if len(set(windows) - {None}) > 1:
            raise ValueError(f"decode cache: one window for every sliding layer, got {windows}")
        self.window = max((w for w in windows if w is not None), default=None)
        # K/V layer -> (in the ring?, its index among the layers of its tensor)
        self.place = {layer: (layer in self.sliding, group.index(layer))
                      for group in (self.full, self.sliding) for layer in group}
        self.shape = (len(self.full), kv_heads, head_dim)
        self.device, self.dtype = torch.device(device), dtype
        self.states = None if state is None else StatePool(state, 1, self.device)
        self.scratch = None if state is None else self.states.take()  # padding rows' slot
        # a group's rows padded to a power of two (few layouts, for CUDA graphs), or exact
        # (on CPU a padding row's attention costs what a request's does)
        self.padded = self.device.type == "cuda" if padded is None else padded
        self.buckets: dict[int, Bucket] = {}
        self.generation = 0  # bumped whenever a tensor a step reads is made or freed
        self.inputs = torch.zeros((4, 0), dtype=torch.int64, device=self.device)
        self.staging = torch.zeros((4, 0), dtype=torch.int64)  # host side (pinned on CUDA)
        self.arange = torch.arange(0, device=self.device)  # row ids and key columns
        self.zero = torch.zeros((), dtype=dtype, device=self.device)  # padding rows' output

    @classmethod
    def for_model(cls, model, padded: bool | None = None) -> DecodeCache:
        """An empty cache in the model's shape, device and dtype."""
        spec, arch = model.spec, model.arch
        return cls(len(arch.kv_layers), spec.kv_heads, spec.head_dim, model.inv_freq.device,
                   model.model.embed_tokens.weight.dtype, arch.kv_windows, model.state_shape,
                   padded)

    def rows(self, width: int, count: int) -> torch.Tensor:
        """Zeroed rows [Lf, 2, count, KVH, width, D] (keys past a length must be finite)."""
        layers, kv_heads, head_dim = self.shape
        self.generation += 1
        return torch.zeros((layers, 2, count, kv_heads, width, head_dim), dtype=self.dtype,
                           device=self.device)

    def ring_rows(self, count: int) -> torch.Tensor | None:
        """Zeroed rings [Ls, 2, count, KVH, window, D] of the sliding layers (None: none)."""
        if not self.sliding:
            return None
        _, kv_heads, head_dim = self.shape
        return torch.zeros((len(self.sliding), 2, count, kv_heads, self.window, head_dim),
                           dtype=self.dtype, device=self.device)

    def add(self, context: torch.Tensor, state=None) -> SequenceKV:
        """A request whose context is context [L, 2, c, KVH, D] of every K/V layer (copied in
        once; of a sliding layer only its last window) and, of a hybrid with linear layers,
        whose state is `state` (StatePool.read's pair)."""
        if (state is None) != (self.states is None):
            raise ValueError("decode cache: a state is given exactly for a model with linear "
                             "layers")
        seq = SequenceKV(self, context.shape[2])
        bucket = self._bucket(width_for(seq.length + 1))
        row = bucket.add(seq)  # first: it may grow the bucket's rows
        full = context if not self.sliding else context[self.full]
        bucket.kv[:, :, row, :, :seq.length] = full.transpose(2, 3)
        if self.sliding:
            first = max(0, seq.length - self.window)
            ring = context[self.sliding, :, first:].transpose(2, 3)  # [Ls, 2, KVH, w, D]
            at = torch.arange(first, seq.length, device=self.device) % self.window
            bucket.ring[:, :, row].index_copy_(3, at, ring)
        if state is not None:
            slots = self.states.slots
            seq.slot = self.states.take()
            self.states.write(seq.slot, *state)
            self.generation += self.states.slots != slots  # the pool doubled: new tensors
        return seq

    def remove(self, seq: SequenceKV) -> None:
        """The request ended: its row (and its state's slot) is free."""
        if seq.bucket is None or seq.cache is not self:
            raise ValueError("decode cache: this sequence is not in the cache")
        self._take_out(seq.bucket, seq.row)
        seq.bucket = None
        if seq.slot is not None:
            self.states.give_back(seq.slot)
            seq.slot = None

    def fit(self, seq: SequenceKV, tokens: int) -> None:
        """Move `seq` to a wider bucket if its row cannot hold `tokens` keys."""
        old, old_row = seq.bucket, seq.row
        if old.width >= tokens:
            return
        new = self._bucket(width_for(tokens))
        row = new.add(seq)
        new.kv[:, :, row, :, :seq.length] = old.kv[:, :, old_row, :, :seq.length]
        if new.ring is not None:
            new.ring[:, :, row] = old.ring[:, :, old_row]
        self._take_out(old, old_row)

    def _take_out(self, bucket: Bucket, row: int) -> None:
        """Free a row; an empty bucket's memory goes back."""
        bucket.remove_row(row)
        if not bucket.seqs:
            del self.buckets[bucket.width]
            self.generation += 1

    def _bucket(self, width: int) -> Bucket:
        if width not in self.buckets:
            self.buckets[width] = Bucket(self, width)
        return self.buckets[width]

    def buffers(self, rows: int, columns: int) -> None:
        """Grow the step's persistent buffers to `rows` batch rows and `columns` keys."""
        if self.inputs.shape[1] < rows:
            self.inputs = torch.zeros((4, rows), dtype=torch.int64, device=self.device)
            pin = self.device.type == "cuda"
            self.staging = torch.zeros((4, rows), dtype=torch.int64, pin_memory=pin)
            self.generation += 1
        if self.arange.shape[0] < columns:
            self.arange = torch.arange(columns, device=self.device)
            self.generation += 1

    @property
    def count(self) -> int:
        return sum(len(b.seqs) for b in self.buckets.values())

    @property
    def nbytes(self) -> int:
        """Bytes held: every bucket's rows and rings, and the state pool."""
        rows = sum(b.kv.numel() * b.kv.element_size() for b in self.buckets.values())
        rings = sum(b.ring.numel() * b.ring.element_size() for b in self.buckets.values()
                    if b.ring is not None)
        return rows + rings + (0 if self.states is None else self.states.nbytes)


class _Group(NamedTuple):
    """One bucket's part of a decode step: batch rows [start, start + rows)."""

    kv: torch.Tensor  # [Lf, 2, capacity, KVH, W, D] the bucket's rows
    ring: torch.Tensor | None  # [Ls, 2, capacity, KVH, window, D] its sliding layers' rings
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
            self.groups.append(_Group(bucket.kv, bucket.ring, start, rows))
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
            full = (places, key_bias(places, columns[:g.kv.shape[4]], dtype))
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
