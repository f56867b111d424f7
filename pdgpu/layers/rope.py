"""Rotary position embedding: the inverse frequencies (with Llama 3.1 scaling), the cos and
signed-sin tables, and the rotation, shared by the dense layers (model.py) and the hybrids'
(layers/hybrid_blocks.py)."""

from __future__ import annotations

import math

import torch

from pdref.models import ModelSpec


def inv_frequencies(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies [D/2] (float32), with Llama 3.1 scaling when the spec has it."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = spec.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin [n, 1, D] for positions [n], computed in float32 then cast.

    The sin table's first half carries rotate-half's minus sign, so `apply_rope` rotates
    with one `roll` instead of two slices, a negation and a cat (the same bits: -a*b is
    a*-b exactly)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [n, D/2]
    cos, sin = freqs.cos(), freqs.sin()  # [n, D/2] each
    cos = torch.cat((cos, cos), dim=-1)  # [n, D]
    signed = torch.cat((-sin, sin), dim=-1)  # [n, D]
    return cos.to(dtype)[:, None, :], signed.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [n, H, D] rotated by position (tables [n, 1, D] from rope_tables): three ops."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
