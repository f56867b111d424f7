"""Decode memory: the K/V of every running request, in rows of equal width so a batch attends
in few calls (its one job; the step over it is decode_batch.py).

A request's context enters once, at admission, gathered straight into its row (`add_paged`)
from where it lies, in pieces of paged K/V in token order (the serving decoder's landing
pool, whose pages hold the prefix and the request's slab: one piece; `pdgpu run`'s decoder
pool and its prefix cache: two), with no context tensor in between (of a sliding layer only
the last window, into its ring). Every row of a bucket is `width` tokens wide (a power of
two, at least MIN_WIDTH), so the bucket's K/V for one layer is one tensor
[2, rows, KVH, width, D] and its requests attend in one call, however ragged their lengths
(attention.decode_attention). Each step appends one K/V row per request in place; a request
about to outgrow its row moves once to the next bucket (a copy of its K/V, once per doubling
of its length); a request that ends leaves its bucket's last row in its place, so a bucket's
rows [0, count) are always its requests. A bucket's rows double when full and halve once a
quarter or less is used, and an empty bucket is freed: the memory held stays within four
rows per running request of its width (tests/test_pdgpu_decode_kv.py). A bucket holds a
tensor per layer so that a resize is made layer by layer, each old layer freed before the
next new one is made: a doubling holds at most the new rows and one old layer's at once
(2 n + n / L rows where n were held, not the old rows beside the new, 3 n).

Hybrids. Sliding-window layers (Gemma 3) keep no growing row: each bucket row also has a
*ring* of `window` positions per sliding layer (`Bucket.ring`), position p at p % window, so
a request's memory for those layers stays the same at any context. Linear layers (Qwen3.5's
gated DeltaNet) keep their state in a slot of a StatePool: the one its state spans land in
(serve/landing.py; `pdgpu run`'s decoder pool, run_decode.py), so a request's state is
landed once where the step reads it and admission copies none of it (`add_paged` adopts the
slot); a padding row
reads and writes the pool's scratch slot, taken when the cache is made.
"""

from __future__ import annotations

import torch

from pdgpu.state_pool import StatePool, StateShape

MIN_WIDTH = 256


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
    """Rows of one width, a tensor per layer: kv[i] [2, capacity, KVH, width, D] of the i-th
    full layer, ring[i] [2, capacity, KVH, window, D] of the i-th sliding one (none without
    sliding layers); row r of each holds seqs[r]. Per layer so that a resize holds one old
    layer beside the new rows, not every old one (see `_resize`)."""

    def __init__(self, cache: DecodeCache, width: int) -> None:
        self.cache, self.width = cache, width
        self.seqs: list[SequenceKV] = []
        self.capacity = 1
        self.kv = [cache.zero_rows(1, width) for _ in cache.full]
        self.ring = [cache.zero_rows(1, cache.window) for _ in cache.sliding]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv + self.ring)

    def add(self, seq: SequenceKV) -> int:
        """Give `seq` the next row (the rows double when full); its row index."""
        if len(self.seqs) == self.capacity:
            self._resize(2 * len(self.seqs))
        seq.bucket, seq.row = self, len(self.seqs)
        self.seqs.append(seq)
        return seq.row

    def remove_row(self, row: int) -> None:
        """Free `row`; the last row moves into its place; the rows halve (repeatedly) while
        a quarter or less of them is used."""
        last = self.seqs.pop()
        if row != len(self.seqs):
            self.copy_row(last.row, self, row, last.length)
            self.seqs[row], last.row = last, row
        if self.seqs and len(self.seqs) <= self.capacity // 4:
            self._resize(2 * rows_for(len(self.seqs)))

    def copy_row(self, row: int, into: Bucket, to: int, length: int) -> None:
        """Row `row`'s first `length` keys (and its rings) into row `to` of `into`."""
        for new, old in zip(into.kv, self.kv, strict=True):
            new[:, to, :, :length] = old[:, row, :, :length]  # [2, KVH, length, D]
        for new, old in zip(into.ring, self.ring, strict=True):
            new[:, to] = old[:, row]  # [2, KVH, window, D]

    def gather(self, row: int, kv: torch.Tensor, slots: torch.Tensor, start: int,
               length: int) -> None:
        """Tokens [start, start + n) of a request of `length` tokens into row `row`, from
        the rows `slots` [n] of the paged K/V kv [L, 2, S, KVH, D]: every one into the full
        layers' columns, those of the last window into the sliding layers' ring columns
        (position p at p % window)."""
        end, window = start + slots.shape[0], self.cache.window
        for layer, into in zip(self.cache.full, self.kv, strict=True):
            _gather(kv[layer], slots, into[:, row, :, start:end])
        if self.ring:
            for a, b in ring_runs(max(start, length - window), end, window):
                column = a % window
                for layer, into in zip(self.cache.sliding, self.ring, strict=True):
                    _gather(kv[layer], slots[a - start:b - start],
                            into[:, row, :, column:column + b - a])

    def _resize(self, capacity: int) -> None:
        """New rows [.., capacity, ..] holding the used ones (a new layout for the step),
        made layer by layer, each old layer freed before the next new one is made: at most
        the new rows and one old layer's are held at once (not the old rows and the new)."""
        used = len(self.seqs)
        for layers, columns in ((self.kv, self.width), (self.ring, self.cache.window)):
            for i in range(len(layers)):
                resized = self.cache.zero_rows(capacity, columns)  # [2, capacity, KVH, W, D]
                resized[:, :used] = layers[i][:, :used]
                layers[i] = resized  # the old layer's last reference
        self.capacity = capacity


def ring_runs(first: int, end: int, window: int) -> list[tuple[int, int]]:
    """Positions [first, end) (at most a window of them) cut where their ring column
    p % window wraps to 0: one or two runs of consecutive columns."""
    if first >= end:
        return []
    wrap = min(end, (first // window + 1) * window)
    return [(first, wrap)] + ([(wrap, end)] if wrap < end else [])


def _gather(kv: torch.Tensor, slots: torch.Tensor, into: torch.Tensor) -> None:
    """The rows `slots` [n] of one layer's paged K/V kv [2, S, KVH, D] into into
    [2, KVH, n, D]: one gather straight into it on one device; from another device's pool,
    gathered there and copied across once."""
    if kv.device == into.device:
        torch.index_select(kv, 1, slots, out=into.transpose(1, 2))
    else:
        into.transpose(1, 2).copy_(kv.index_select(1, slots))


class DecodeCache:
    """Every running request's K/V on one device, in buckets by row width, and the decode
    step's persistent buffers."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, device, dtype,
                 windows: tuple[int | None, ...] | None = None,
                 state: StateShape | None = None, padded: bool | None = None,
                 states: StatePool | None = None) -> None:
        windows = windows or (None,) * layers  # per K/V layer: its window, None if full
        self.full = [i for i, w in enumerate(windows) if w is None]
        self.sliding = [i for i, w in enumerate(windows) if w is not None]
        if len(set(windows) - {None}) > 1:
            raise ValueError(f"decode cache: one window for every sliding layer, got {windows}")
        self.window = max((w for w in windows if w is not None), default=None)
        # K/V layer -> (in the ring?, its index in a bucket's list: kv's, or ring's)
        self.place = {layer: (layer in self.sliding, group.index(layer))
                      for group in (self.full, self.sliding) for layer in group}
        self.shape = (len(self.full), kv_heads, head_dim)
        self.device, self.dtype = torch.device(device), dtype
        # the linear layers' states: a pool shared with whoever lands them, or its own
        self.states = states if states is not None or state is None \
            else StatePool(state, 1, self.device)
        self.scratch = None if self.states is None else self.states.take()  # padding rows'
        self.state_slots = 0 if self.states is None else self.states.slots  # seen so far
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
    def for_model(cls, model, padded: bool | None = None,
                  states: StatePool | None = None) -> DecodeCache:
        """An empty cache in the model's shape, device and dtype (its linear layers' states
        in `states`, or in a pool of its own)."""
        spec, arch = model.spec, model.arch
        return cls(len(arch.kv_layers), spec.kv_heads, spec.head_dim, model.inv_freq.device,
                   model.model.embed_tokens.weight.dtype, arch.kv_windows, model.state_shape,
                   padded, states)

    def zero_rows(self, count: int, columns: int) -> torch.Tensor:
        """One layer's zeroed rows [2, count, KVH, columns, D] (keys past a length must be
        finite)."""
        _, kv_heads, head_dim = self.shape
        self.generation += 1
        return torch.zeros((2, count, kv_heads, columns, head_dim), dtype=self.dtype,
                           device=self.device)

    def add(self, context: torch.Tensor, state=None) -> SequenceKV:
        """A request whose context is context [L, 2, c, KVH, D] of every K/V layer and, of a
        hybrid with linear layers, whose state is `state` (StatePool.read's pair), copied
        into a slot of the cache's pool (see `add_paged`)."""
        if (state is None) != (self.states is None):
            raise ValueError("decode cache: a state is given exactly for a model with linear "
                             "layers")
        slots = torch.arange(context.shape[2], device=context.device)  # [c]
        return self.add_paged(((context, slots),), None if state is None else self.own(state))

    def own(self, state) -> int:
        """A slot of the cache's state pool holding a copy of `state` (StatePool.read's
        pair, from any device), for `add_paged`."""
        slot = self.states.take()
        self.states.write(slot, *state)
        return slot

    def add_paged(self, parts, state_slot: int | None = None) -> SequenceKV:
        """A request whose context is `parts`, pieces of paged K/V in token order: each a
        pair (kv [L, 2, S, KVH, D], slots [n]), its next n tokens in the rows `slots` of kv,
        gathered once straight into the request's row (of a sliding layer only the last
        window, into its ring); of a hybrid with linear layers, whose state is in slot
        `state_slot` of the cache's state pool, which the request now holds (and `remove`
        gives back)."""
        if (state_slot is None) != (self.states is None):
            raise ValueError("decode cache: a state slot is given exactly for a model with "
                             "linear layers")
        seq = SequenceKV(self, sum(slots.shape[0] for _, slots in parts))
        bucket = self._bucket(width_for(seq.length + 1))
        row = bucket.add(seq)  # first: it may grow the bucket's rows
        start = 0
        for kv, slots in parts:
            bucket.gather(row, kv, slots, start, seq.length)
            start += slots.shape[0]
        seq.slot = state_slot
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
        old.copy_row(old_row, new, new.add(seq), seq.length)
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
        """Grow the step's persistent buffers to `rows` batch rows and `columns` keys (and
        note a state pool that grew: its tensors are new)."""
        if self.states is not None and self.states.slots != self.state_slots:
            self.state_slots = self.states.slots
            self.generation += 1
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
        rows = sum(b.nbytes for b in self.buckets.values())
        return rows + (0 if self.states is None else self.states.nbytes)


