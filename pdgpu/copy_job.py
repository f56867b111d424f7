"""What goes through the copier and what comes back: a span's CopyJob, the copier's sizes
(CopierConfig), each stage's times and the span's CopyResult, and the injected CopyFault."""

from __future__ import annotations

import attrs
import torch

from pdgpu.decoder_pool import Slab
from pdgpu.handoff import KVPiece
from pdgpu.streams import Mark
from pdref.intervals import Range


class CopyFault(RuntimeError):
    """The injected failure of one copy (fault injection)."""


@attrs.frozen
class CopyJob:
    """One span to move: source region of a request into its decoder slab."""

    span: int
    req: str
    layers: Range
    tokens: Range
    src_slots: torch.Tensor  # [prompt] source slot per position
    slab: Slab
    ready: Mark  # the span's region is computed once this is done (Copier.mark_ready)
    fail: bool = False  # fault injection: write half the span, then fail
    # what it moves (handoff.py): a dense model's region is its one piece
    pieces: tuple = attrs.field(default=attrs.Factory(
        lambda self: (KVPiece(self.layers, self.tokens),), takes_self=True))


@attrs.frozen
class StageTime:
    name: str
    start: float
    end: float
    resource: str


@attrs.frozen
class CopyResult:
    job: CopyJob
    error: str | None
    stages: tuple[StageTime, ...]
    done_t: float  # run clock when every stage was seen complete (the writer has stopped)


@attrs.frozen
class CopierConfig:
    slots: int  # staging buffers in the ring (= the spans that may be in flight)
    span_elems: int  # elements of the largest span: each buffer's size
    link_gbps: float | None = None  # pace d2h and h2d each to this many GB/s (1e9 bytes/s)
