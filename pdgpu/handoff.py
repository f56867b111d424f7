"""What crosses from a producer to the decoder for one model, and where it sits on each side.

A dense model's handoff geometry is its K/V geometry (contract v2). A hybrid's (contract v3)
names every model layer with its kind: `full`, `sliding` (its window) or `linear` (one
request's state of that layer in bytes, as the engine stores it: a conv window in the model's
dtype and a float32 recurrent matrix, `StateShape`). Spans name model layers; the engine's
caches (the producer's source pages, the decoder's slabs) hold the K/V layers only, numbered
among themselves, and the state pools the linear layers, numbered among themselves
(pdgpu/arch.py). This module maps one onto the other, from the geometry alone, so producer
and decoder agree on a span's payload without asking each other:

  a KV span over model layers x tokens  ->  *groups*: runs of consecutive K/V layers that
      carry the same tokens (a full layer every token of the span, a sliding layer only those
      in its window, `pdref.kinds.window_range`), each one tensor [n, 2, nt, KVH, D]
  a state span over linear layers      ->  state indices [s0, s1) of the state pools

`pdgpu run`'s copier moves a span as *pieces* (`pieces`): a `KVPiece` per group, or one
`StatePiece` (the state indices, the producer's slot it reads, the decoder's it lands in),
each staged at an ALIGN-byte offset of one staging buffer (`staged`); their bytes are the
span's `bytes` (`Region.span_bytes`) exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from pdgpu.arch import HYBRID, arch_of
from pdgpu.state_pool import StateShape
from pdref.geometry import Geometry
from pdref.intervals import Range, intersect, is_empty, length
from pdref.kinds import FULL, LINEAR, SLIDING, LayerKind, window_range
from pdref.models import ModelSpec
from pdref.plan import Region

ALIGN = 16  # bytes: each piece starts at a multiple in a staging buffer (any dtype view fits)


class Group(NamedTuple):
    """K/V layers [lo, hi) of the engine's caches (K/V index), all carrying `tokens`."""

    layers: Range
    tokens: Range


def handoff_geometry(spec: ModelSpec, page_tokens: int) -> Geometry:
    """The geometry a run's trace names: (v3) every layer of a hybrid the engine implements
    with its kind; any other model's own geometry (a dense model's K/V, v2)."""
    if spec.arch not in HYBRID:
        return spec.geometry(page_tokens)
    arch = arch_of(spec)
    from pdgpu.model import torch_dtype  # the model's module imports torch's layers

    state = StateShape.for_arch(arch, torch_dtype(spec))
    made = {FULL: lambda: LayerKind(FULL), SLIDING: lambda: LayerKind(SLIDING, arch.window),
            LINEAR: lambda: LayerKind(LINEAR, None, state.nbytes // state.layers)}
    kinds = tuple(made[k]() for k in arch.kinds)
    return Geometry(layers=spec.layers, kv_heads=spec.kv_heads, head_dim=spec.head_dim,
                    dtype_bytes=spec.dtype_bytes, page_tokens=page_tokens,
                    recurrent=state is not None, kinds=kinds)


def unshipped_state(spec: ModelSpec) -> bool:
    """True when the model keeps a recurrent state that no span of this engine carries (a
    recurrent model the engine has no hybrid implementation of): layer mode would hand off
    its attention K/V alone (CFG-1)."""
    return spec.recurrent and spec.arch not in HYBRID


def kv_geometry(geometry: Geometry) -> Geometry:
    """The geometry of the engine's paged caches: its K/V layers only, no kinds."""
    if geometry.kinds is None:
        return geometry
    kv_layers = sum(k.kind != LINEAR for k in geometry.kinds)
    return Geometry(kv_layers, geometry.kv_heads, geometry.head_dim, geometry.dtype_bytes,
                    geometry.page_tokens)


def _index(geometry: Geometry, layer: int, linear: bool) -> int:
    """How many layers before model layer `layer` are (not) linear."""
    return sum((k.kind == LINEAR) == linear for k in geometry.kinds[:layer])


def kv_range(geometry: Geometry, layers: Range) -> Range:
    """The K/V layers (the paged caches' numbering) among model layers `layers`."""
    if geometry.kinds is None:
        return layers
    return (_index(geometry, layers[0], False), _index(geometry, layers[1], False))


def state_range(geometry: Geometry, layers: Range) -> Range:
    """The state-pool layers of a state span over (linear) model layers `layers`."""
    return (_index(geometry, layers[0], True), _index(geometry, layers[1], True))


def kv_groups(geometry: Geometry, layers: Range, tokens: Range, prompt: int,
              prefix: int) -> tuple[Group, ...]:
    """The groups of a KV span over model layers x tokens, in layer order (empty ones left
    out); one group over the same layers without kinds."""
    if geometry.kinds is None:
        return (Group(layers, tokens),) if tokens[0] < tokens[1] else ()
    groups: list[Group] = []
    kv = _index(geometry, layers[0], False)
    for layer in range(*layers):
        kind = geometry.kinds[layer]
        if kind.kind == LINEAR:
            continue
        cut = tokens if kind.kind == FULL else intersect(
            tokens, window_range(kind.window, prompt, prefix, geometry.page_tokens))
        if not is_empty(cut):
            last = groups[-1] if groups else None
            if last is not None and last.layers[1] == kv and last.tokens == cut:
                groups[-1] = Group((last.layers[0], kv + 1), cut)
            else:
                groups.append(Group((kv, kv + 1), cut))
        kv += 1
    return tuple(groups)


@attrs.frozen
class KVPiece:
    """K/V layers [a, b) of the paged caches (K/V index) x tokens: one group."""

    layers: Range
    tokens: Range

    def size(self, cell_bytes: int) -> int:
        """Its bytes, `cell_bytes` those of one (layer, token): K and V of every head."""
        return cell_bytes * length(self.layers) * length(self.tokens)


@attrs.frozen
class StatePiece:
    """State-pool layers [a, b): their state in the producer's slot `source_slot`, into the
    decoder's slot `slot`."""

    layers: Range
    source_slot: int
    slot: int
    nbytes: int

    def size(self, _cell_bytes: int) -> int:
        return self.nbytes


def pieces(geometry: Geometry, region: Region, prompt: int, prefix: int,
           slots: tuple[int, int] | None = None) -> tuple:
    """The pieces a span of `region` moves for a request of `prompt` tokens, `prefix`
    cached; a state span's read the producer's and write the decoder's state `slots`."""
    if region.state:
        return (StatePiece(state_range(geometry, region.layers), *slots,
                           geometry.state_bytes(region.layers)),)
    return tuple(KVPiece(*g) for g in kv_groups(geometry, region.layers, region.tokens,
                                                 prompt, prefix))


def staged(parts: tuple, cell_bytes: int) -> tuple[tuple[int, ...], int]:
    """Where each piece lies in a staging buffer (byte offsets, each a multiple of ALIGN)
    and the bytes the buffer needs (`cell_bytes`: K/V bytes of one layer and token)."""
    offsets, at = [], 0
    for piece in parts:
        offsets.append(at)
        at += -(-piece.size(cell_bytes) // ALIGN) * ALIGN
    return tuple(offsets), at
