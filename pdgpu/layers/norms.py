"""The hybrids' RMSNorms: weights stored as an offset from 1, and the gated output norm."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x in float32 scaled to unit root-mean-square over its last dimension."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class OffsetRMSNorm(nn.Module):
    """Qwen3.5's and Gemma 3's RMSNorm: the weight is stored as w - 1 and the product is
    taken in float32 before the cast ((x * (1 + w)).to(dtype), not x.to(dtype) * w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet's output norm: normalize, scale, then multiply by silu(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = self.weight * _normalized(x, self.eps).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)
