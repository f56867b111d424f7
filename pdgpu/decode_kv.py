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
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdgpu.attention import decode_attention, key_padding

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


class Bucket:
    """Rows of one width: kv [L, 2, rows, KVH, width, D]; row i holds seqs[i]."""

    def __init__(self, cache: DecodeCache, width: int) -> None:
        self.cache, self.width = cache, width
        self.seqs: list[SequenceKV] = []
        self.kv = cache.rows(width, 1)

    def add(self, seq: SequenceKV) -> int:
        """Give `seq` the next row (the rows double when full); its row index."""
        if len(self.seqs) == self.kv.shape[2]:
            grown = self.cache.rows(self.width, 2 * len(self.seqs))
            grown[:, :, :len(self.seqs)] = self.kv
            self.kv = grown
        seq.bucket, seq.row = self, len(self.seqs)
        self.seqs.append(seq)
        return seq.row

    def remove_row(self, row: int) -> None:
        """Free `row`; the last row moves into its place."""
        last = self.seqs.pop()
        if row != len(self.seqs):
            self.kv[:, :, row, :, :last.length] = self.kv[:, :, last.row, :, :last.length]
            self.seqs[row], last.row = last, row


class DecodeCache:
    """Every running request's K/V on one device, in buckets by row width."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, device, dtype) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.device, self.dtype = torch.device(device), dtype
        self.buckets: dict[int, Bucket] = {}

    @classmethod
    def for_model(cls, model) -> DecodeCache:
        """An empty cache in the model's shape, device and dtype."""
        spec = model.spec
        return cls(spec.layers, spec.kv_heads, spec.head_dim, model.inv_freq.device,
                   model.model.embed_tokens.weight.dtype)

    def rows(self, width: int, count: int) -> torch.Tensor:
        """Zeroed rows [L, 2, count, KVH, width, D] (keys past a length must be finite)."""
        layers, kv_heads, head_dim = self.shape
        return torch.zeros((layers, 2, count, kv_heads, width, head_dim), dtype=self.dtype,
                           device=self.device)

    def add(self, context: torch.Tensor) -> SequenceKV:
        """A request whose context is context [L, 2, c, KVH, D] (copied in once)."""
        seq = SequenceKV(self, context.shape[2])
        bucket = self._bucket(width_for(seq.length + 1))
        row = bucket.add(seq)  # first: it may grow the bucket's rows
        bucket.kv[:, :, row, :, :seq.length] = context.transpose(2, 3)
        return seq

    def remove(self, seq: SequenceKV) -> None:
        """The request ended: its row is free."""
        if seq.bucket is None or seq.cache is not self:
            raise ValueError("decode cache: this sequence is not in the cache")
        self._take_out(seq.bucket, seq.row)
        seq.bucket = None

    def fit(self, seq: SequenceKV, tokens: int) -> None:
        """Move `seq` to a wider bucket if its row cannot hold `tokens` keys."""
        old, old_row = seq.bucket, seq.row
        if old.width >= tokens:
            return
        new = self._bucket(width_for(tokens))
        row = new.add(seq)
        new.kv[:, :, row, :, :seq.length] = old.kv[:, :, old_row, :, :seq.length]
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
        return sum(b.kv.numel() * b.kv.element_size() for b in self.buckets.values())


class _Group(NamedTuple):
    """One bucket's part of a decode step, made once for every layer of it."""

    bucket: Bucket
    order: torch.Tensor  # [n] the batch row of each of the bucket's rows
    rows: torch.Tensor  # [n] 0..n-1
    positions: torch.Tensor  # [n] where each row's new token goes
    pad: torch.Tensor  # [n, 1, 1, W] keys past each row's new length


class DecodeBatch:
    """One decode step over every request of a cache, in the caller's order (batch rows)."""

    def __init__(self, seqs: list[SequenceKV]) -> None:
        cache = seqs[0].cache
        if any(s.cache is not cache or s.bucket is None for s in seqs) or \
                len(set(map(id, seqs))) != cache.count or len(seqs) != cache.count:
            raise ValueError("decode batch: every request of one decode cache, once each")
        for seq in seqs:
            cache.fit(seq, seq.length + 1)
        self.seqs, self.device = seqs, cache.device
        where = {id(s): i for i, s in enumerate(seqs)}
        self.groups = [self._group(b, where) for b in cache.buckets.values() if b.seqs]

    def _group(self, bucket: Bucket, where: dict) -> _Group:
        order = torch.tensor([where[id(s)] for s in bucket.seqs], device=self.device)
        positions = torch.tensor([s.length for s in bucket.seqs], device=self.device)
        rows = torch.arange(len(bucket.seqs), device=self.device)
        return _Group(bucket, order, rows, positions, key_padding(positions + 1, bucket.width))

    def positions(self, device) -> torch.Tensor:
        """Where each row's new token sits: its request's current length -> [B]."""
        return torch.tensor([s.length for s in self.seqs], dtype=torch.int64, device=device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [B, H, D], k/v [B, KVH, D]: store each row's k/v at its next position, then each
        bucket's attention in one call -> [B, H, D]."""
        out = torch.empty_like(q)
        for g in self.groups:
            n = len(g.rows)
            keys, values = g.bucket.kv[layer, 0], g.bucket.kv[layer, 1]  # [rows, KVH, W, D]
            keys[g.rows, :, g.positions] = k[g.order]  # [n, KVH, D]
            values[g.rows, :, g.positions] = v[g.order]
            out[g.order] = decode_attention(q[g.order], keys[:n], values[:n], g.pad)
        return out

    def advance(self) -> None:
        """After a step: every request holds one more token."""
        for seq in self.seqs:
            seq.length += 1


@torch.no_grad()
def decode_tokens(model, batch: DecodeBatch, tokens: list[int]) -> list[int]:
    """One greedy step: feed each request's last token, get its next token."""
    device = model.inv_freq.device
    inputs = torch.tensor(tokens, dtype=torch.int64, device=device)  # [B]
    logits = model.decode_step(inputs, batch.positions(device), batch)  # [B, V]
    batch.advance()
    return logits.argmax(dim=-1).tolist()
