"""What a layer's attention hands its K/V to (the model owns no KV cache): the producer's
paged source cache in prefill, a decode batch's rows in decode. Apart from model.py so that
the hybrid layers (layers/hybrid_blocks.py), which model.py builds, need not import it."""

from __future__ import annotations

from typing import Protocol

import torch


class KVStore(Protocol):
    """Where attention keeps K/V: store this chunk's kv [n, 2, KVH, D] (K then V of each
    token) and return the request's K/V up to its end ([KVH, start + n, D] each, the last
    dimension contiguous)."""

    def append(self, layer: int, start: int,
               kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecodeKV(Protocol):
    """K/V of a padded decode batch. `masks(positions, dtype)` runs once a step (what every
    layer's attention shares); `attend` stores row i's new k/v at positions[i] and returns
    the attention of its query over its request's keys, [R, H * D]."""

    def masks(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               masks: tuple) -> torch.Tensor: ...
