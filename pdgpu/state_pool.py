"""Per-request state of a hybrid's linear layers, in slots: the producer's and the decoder's.

A request of a model with gated DeltaNet layers carries, per linear layer, a state of fixed
size whatever its length: `conv` [C, K-1] (the model's dtype) and `recurrent` [Hv, Dk, Dv]
(float32). A pool holds them for many requests, layer-major, so that a decode batch reads a
layer's states of all its requests in one call (`gather`) and writes them back in one
(`scatter`):
    conv      [NL, slots, C, K-1]
    recurrent [NL, slots, Hv, Dk, Dv]
A slot stays where it is from `take` to `give_back` (a copy may read it meanwhile); `take`
hands out the lowest free slot zeroed (a prompt starts from a zero state) and doubles the
pool when none is free.
"""

from __future__ import annotations

import attrs
import torch

from pdgpu.arch import Arch
from pdref.intervals import Range


@attrs.frozen
class StateShape:
    """The state of one request: per linear layer a conv window and a recurrent matrix."""

    layers: int
    conv: tuple[int, int]  # [C, K-1]
    recurrent: tuple[int, int, int]  # [Hv, Dk, Dv]
    dtype: torch.dtype  # the conv window's (the model's); the recurrent state is float32

    @classmethod
    def for_arch(cls, arch: Arch, dtype: torch.dtype) -> StateShape | None:
        """The state of a model of `arch` in `dtype`; None when it has no linear layer."""
        s = arch.linear
        if s is None or not arch.linear_layers:
            return None
        return cls(len(arch.linear_layers), (s.conv_dim, s.conv_kernel - 1),
                   (s.value_heads, s.key_dim, s.value_dim), dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of one request's state, every linear layer."""
        conv = self.conv[0] * self.conv[1] * torch.empty((), dtype=self.dtype).element_size()
        rec = self.recurrent[0] * self.recurrent[1] * self.recurrent[2] * 4
        return self.layers * (conv + rec)


def state_views(shape: StateShape, layers: int, raw: torch.Tensor):
    """`layers` layers' state laid out in bytes raw [nbytes] (uint8, 4-byte aligned): the
    recurrent matrices [nl, Hv, Dk, Dv] (float32) first, then the conv windows [nl, C, K-1]."""
    rec_bytes = layers * shape.recurrent[0] * shape.recurrent[1] * shape.recurrent[2] * 4
    recurrent = raw[:rec_bytes].view(torch.float32).view(layers, *shape.recurrent)
    conv = raw[rec_bytes:].view(shape.dtype).view(layers, *shape.conv)
    return conv, recurrent


class StatePool:
    """Slots of per-request linear-layer state on one device."""

    def __init__(self, shape: StateShape, slots: int, device) -> None:
        self.shape, self.device = shape, torch.device(device)
        self.conv, self.recurrent = self._tensors(slots)
        self.free = list(range(slots))  # kept sorted: the lowest free slot first

    def _tensors(self, slots: int):
        s = self.shape
        conv = torch.zeros((s.layers, slots, *s.conv), dtype=s.dtype, device=self.device)
        rec = torch.zeros((s.layers, slots, *s.recurrent), dtype=torch.float32,
                          device=self.device)
        return conv, rec

    @property
    def slots(self) -> int:
        return self.conv.shape[1]

    @property
    def nbytes(self) -> int:
        return self.slots * self.shape.nbytes

    def take(self) -> int:
        """A free slot, zeroed (the pool doubles when every slot is taken)."""
        if not self.free:
            self._double()
        slot = self.free.pop(0)
        self._zero(slot)
        return slot

    def claim(self, slot: int) -> None:
        """Slot `slot`, named by someone else, zeroed (the pool doubles until it holds it).
        A serving producer's slots are named by the decoder's `reserve` (contract v3), which
        names one only once pdref has it free: no earlier life computes into it any more and
        no span it counts reads it (STATE-4), so whatever held it here is done with it."""
        if slot < 0:
            raise ValueError(f"state pool: slot must be >= 0, got {slot}")
        while slot >= self.slots:
            self._double()
        if slot in self.free:
            self.free.remove(slot)
        self._zero(slot)

    def _double(self) -> None:
        old = self.slots
        conv, rec = self._tensors(2 * old)
        conv[:, :old], rec[:, :old] = self.conv, self.recurrent
        self.conv, self.recurrent = conv, rec
        self.free = sorted(self.free + list(range(old, 2 * old)))

    def _zero(self, slot: int) -> None:
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def give_back(self, slot: int) -> None:
        if slot in self.free or not 0 <= slot < self.slots:
            raise ValueError(f"state pool: slot {slot} is not taken")
        self.free.append(slot)
        self.free.sort()

    def views(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear layer `layer`'s state in `slot`: conv [C, K-1], recurrent [Hv, Dk, Dv]
        (views: a prefill chunk updates them in place)."""
        return self.conv[layer, slot], self.recurrent[layer, slot]

    def read(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of a slot's state: conv [NL, C, K-1], recurrent [NL, Hv, Dk, Dv]."""
        return self.conv[:, slot].clone(), self.recurrent[:, slot].clone()

    def write(self, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Import a request's state (as `read` gives it) into `slot`."""
        self.conv[:, slot] = conv
        self.recurrent[:, slot] = recurrent

    def copy_out(self, layers: Range, slot: int, conv: torch.Tensor,
                 recurrent: torch.Tensor) -> None:
        """Layers [a, b)'s state in `slot` into conv [nl, C, K-1], recurrent [nl, Hv, Dk, Dv]
        (a state span's gather)."""
        conv.copy_(self.conv[layers[0]:layers[1], slot])
        recurrent.copy_(self.recurrent[layers[0]:layers[1], slot])

    def copy_in(self, layers: Range, slot: int, conv: torch.Tensor,
                recurrent: torch.Tensor) -> None:
        """The inverse of `copy_out`: a state span's landing into `slot`."""
        self.conv[layers[0]:layers[1], slot].copy_(conv)
        self.recurrent[layers[0]:layers[1], slot].copy_(recurrent)

    def scrub(self, slot: int) -> None:
        """NaN into `slot`, so a reader of a state that never landed cannot pass parity."""
        self.conv[:, slot].fill_(float("nan"))
        self.recurrent[:, slot].fill_(float("nan"))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of `slots` [B] for one layer: conv [B, C, K-1], recurrent [B, Hv, Dk, Dv]."""
        return self.conv[layer].index_select(0, slots), self.recurrent[layer].index_select(0, slots)

    def scatter(self, layer: int, slots: torch.Tensor, conv: torch.Tensor,
                recurrent: torch.Tensor) -> None:
        """Write one layer's states of `slots` [B] back (the inverse of `gather`)."""
        self.conv[layer].index_copy_(0, slots, conv.to(self.shape.dtype))
        self.recurrent[layer].index_copy_(0, slots, recurrent)
