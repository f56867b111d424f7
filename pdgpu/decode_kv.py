"""The K/V requests decode with, kept in rows of equal width so a batch attends in few calls.

At admission a request's context (prefix cache + the slab its spans landed in, or a single-
process prefill) is copied once into a row of a `DecodeCache` bucket: every row of a bucket
is `width` tokens wide (a power of two, at least MIN_WIDTH), so the bucket's K/V for one layer
is one tensor [rows, KVH, width, D] and its requests attend in one call, however ragged their
lengths (attention.decode_attention). Each step appends one K/V row per request in place; a
request about to outgrow its row moves once to the next bucket (a copy of its K/V, once per
doubling of its length); a request that ends leaves its bucket's last row in its place, so a
bucket's rows [0, count) are always its requests. A step makes one attention call per
bucket in use: a handful (1k..4k contexts fill three), never one per request.

Hybrids. Sliding-window layers (Gemma 3) keep no growing row: each bucket row also has a
*ring* of `window` positions per sliding layer (`Bucket.ring`), position p at p % window, so
a request's memory for those layers stays the same at any context; attention over a ring is
order-free (softmax over a set), masked to the positions written so far. Linear layers
(Qwen3.5's gated DeltaNet) keep their state in a slot of the cache's StatePool, which a step
reads and writes once per layer for the whole batch (`read_states` / `write_states`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdgpu.attention import decode_attention, key_padding
from pdgpu.state_pool import StatePool, StateShape

MIN_WIDTH = 256


def width_for(tokens: int) -> int:
    """The row width that holds `tokens` keys: a power of two, at least MIN_WIDTH."""
    return max(MIN_WIDTH, 1 << (tokens - 1).bit_length())


class SequenceKV:
    """One request in a DecodeCache: its bucket, its row there and its length so far."""

    def __init__(self, cache: DecodeCache, length: int) -> None:
        self.cache, self.length = cache, length
        self.bucket: Bucket | None = None
        self.row = 0
        self.slot: int | None = None  # its linear-layer state's slot (hybrids)


class Bucket:
    """Rows of one width: kv [Lf, 2, rows, KVH, width, D] of the full layers, ring
    [Ls, 2, rows, KVH, window, D] of the sliding ones (or None); row i holds seqs[i]."""

    def __init__(self, cache: DecodeCache, width: int) -> None:
        self.cache, self.width = cache, width
        self.seqs: list[SequenceKV] = []
        self.kv = cache.rows(width, 1)
        self.ring = cache.ring_rows(1)

    def add(self, seq: SequenceKV) -> int:
        """Give `seq` the next row (the rows double when full); its row index."""
        if len(self.seqs) == self.kv.shape[2]:
            grown = self.cache.rows(self.width, 2 * len(self.seqs))
            grown[:, :, :len(self.seqs)] = self.kv
            self.kv = grown
            if self.ring is not None:
                ring = self.cache.ring_rows(2 * len(self.seqs))
                ring[:, :, :len(self.seqs)] = self.ring
                self.ring = ring
        seq.bucket, seq.row = self, len(self.seqs)
        self.seqs.append(seq)
        return seq.row

    def remove_row(self, row: int) -> None:
        """Free `row`; the last row moves into its place."""
        last = self.seqs.pop()
        if row != len(self.seqs):
            self.kv[:, :, row, :, :last.length] = self.kv[:, :, last.row, :, :last.length]
            if self.ring is not None:
                self.ring[:, :, row] = self.ring[:, :, last.row]
            self.seqs[row], last.row = last, row


class DecodeCache:
    """Every running request's K/V on one device, in buckets by row width."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, device, dtype,
                 windows: tuple[int | None, ...] | None = None,
                 state: StateShape | None = None) -> None:
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
        self.buckets: dict[int, Bucket] = {}
        self.states = None if state is None else StatePool(state, 1, self.device)

    @classmethod
    def for_model(cls, model) -> DecodeCache:
        """An empty cache in the model's shape, device and dtype."""
        spec, arch = model.spec, model.arch
        return cls(len(arch.kv_layers), spec.kv_heads, spec.head_dim, model.inv_freq.device,
                   model.model.embed_tokens.weight.dtype, arch.kv_windows, model.state_shape)

    def rows(self, width: int, count: int) -> torch.Tensor:
        """Zeroed rows [Lf, 2, count, KVH, width, D] (keys past a length must be finite)."""
        layers, kv_heads, head_dim = self.shape
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
        if (state is None) != (self.states is None):
            raise ValueError("decode cache: a state is given exactly for a model with linear "
                             "layers")
        if state is not None:
            seq.slot = self.states.take()
            self.states.write(seq.slot, *state)
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

    def _bucket(self, width: int) -> Bucket:
        if width not in self.buckets:
            self.buckets[width] = Bucket(self, width)
        return self.buckets[width]

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
    """One bucket's part of a decode step, made once for every layer of it."""

    bucket: Bucket
    order: torch.Tensor  # [n] the batch row of each of the bucket's rows
    rows: torch.Tensor  # [n] 0..n-1
    positions: torch.Tensor  # [n] where each row's new token goes
    pad: torch.Tensor  # [n, 1, 1, W] keys past each row's new length
    ring_at: torch.Tensor | None  # [n] where it goes in the sliding layers' rings
    ring_pad: torch.Tensor | None  # [n, 1, 1, window] ring positions not written yet


class DecodeBatch:
    """One decode step over every request of a cache, in the caller's order (batch rows)."""

    def __init__(self, seqs: list[SequenceKV]) -> None:
        cache = seqs[0].cache
        if any(s.cache is not cache or s.bucket is None for s in seqs) or \
                len(set(map(id, seqs))) != cache.count or len(seqs) != cache.count:
            raise ValueError("decode batch: every request of one decode cache, once each")
        for seq in seqs:
            cache.fit(seq, seq.length + 1)
        self.seqs, self.cache, self.device = seqs, cache, cache.device
        where = {id(s): i for i, s in enumerate(seqs)}
        self.groups = [self._group(b, where) for b in cache.buckets.values() if b.seqs]
        if cache.states is not None:
            self.slots = torch.tensor([s.slot for s in seqs], device=self.device)  # [B]

    def _group(self, bucket: Bucket, where: dict) -> _Group:
        order = torch.tensor([where[id(s)] for s in bucket.seqs], device=self.device)
        positions = torch.tensor([s.length for s in bucket.seqs], device=self.device)
        rows = torch.arange(len(bucket.seqs), device=self.device)
        pad = key_padding(positions + 1, bucket.width)
        window = self.cache.window
        if window is None:
            return _Group(bucket, order, rows, positions, pad, None, None)
        ring_pad = key_padding((positions + 1).clamp(max=window), window)
        return _Group(bucket, order, rows, positions, pad, positions % window, ring_pad)

    def positions(self, device) -> torch.Tensor:
        """Where each row's new token sits: its request's current length -> [B]."""
        return torch.tensor([s.length for s in self.seqs], dtype=torch.int64, device=device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [B, H, D], k/v [B, KVH, D]: store each row's k/v at its next position, then each
        bucket's attention in one call -> [B, H, D]."""
        out = torch.empty_like(q)
        ring, index = self.cache.place[layer]
        for g in self.groups:
            n = len(g.rows)
            store = g.bucket.ring if ring else g.bucket.kv
            at, pad = (g.ring_at, g.ring_pad) if ring else (g.positions, g.pad)
            keys, values = store[index, 0], store[index, 1]  # [rows, KVH, W, D]
            keys[g.rows, :, at] = k[g.order]  # [n, KVH, D]
            values[g.rows, :, at] = v[g.order]
            out[g.order] = decode_attention(q[g.order], keys[:n], values[:n], pad)
        return out

    def read_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear layer `layer`'s state of every row: conv [B, C, K-1], recurrent
        [B, Hv, Dk, Dv] (one gather for the batch)."""
        return self.cache.states.gather(layer, self.slots)

    def write_states(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store each row's new state of linear layer `layer` (one scatter for the batch)."""
        self.cache.states.scatter(layer, self.slots, conv, recurrent)

    def advance(self) -> None:
        """After a step: every request holds one more token."""
        for seq in self.seqs:
            seq.length += 1


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> the most likely token of each row [B]."""
    return logits.argmax(dim=-1)


@torch.no_grad()
def decode_tokens(model, batch: DecodeBatch, tokens: list[int], pick=greedy) -> list[int]:
    """One step: feed each request's last token, get its next token (`pick`: logits [B, V] ->
    tokens [B], greedy unless the requests sample; sampler.py)."""
    device = model.inv_freq.device
    inputs = torch.tensor(tokens, dtype=torch.int64, device=device)  # [B]
    logits = model.decode_step(inputs, batch.positions(device), batch)  # [B, V]
    batch.advance()
    return pick(logits).tolist()
