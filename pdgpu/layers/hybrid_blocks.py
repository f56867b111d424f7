"""The hybrid families' attention and blocks (Qwen3.5, Gemma 3), beside model.py's dense ones.

Attention (`self_attn`), as the dense one, hands its new K/V to the KVStore / DecodeKV under
its K/V index, plus per family:
  Qwen3.5  q_proj gives each head's query and an output gate side by side; RoPE on the
           first `rotary_dim` dims of a head only; the output is multiplied by
           sigmoid(gate) before o_proj
  Gemma 3  scores scaled by query_pre_attn_scalar^-0.5 (not head_dim^-0.5); sliding layers
           attend the last `window` positions only (prefill: attention.py's window; decode:
           the decode cache's ring rows of that layer)
Both normalize q and k per head with OffsetRMSNorm. Blocks: Qwen3.5 is pre-norm like Qwen3
(its mixer a gated DeltaNet on linear layers); Gemma 3 also normalizes each sublayer's
output before the residual add (post_attention / pre_ and post_feedforward norms).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from pdgpu.arch import Arch
from pdgpu.attention import prefill_attention
from pdgpu.layers.gated_deltanet import GatedDeltaNet
from pdgpu.layers.kv_ports import DecodeKV, KVStore
from pdgpu.layers.norms import OffsetRMSNorm
from pdgpu.layers.rope import apply_rope
from pdref.models import ModelSpec


def rope_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, H, D] with its first cos.shape[-1] dims rotated (partial RoPE); the rest as is."""
    dims = cos.shape[-1]
    if dims == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :dims], cos, sin), x[..., dims:]), dim=-1)


class HybridAttention(nn.Module):
    def __init__(self, spec: ModelSpec, gated: bool, window: int | None,
                 query_scale: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.gated, self.window = gated, window
        # the kernels scale by head_dim^-0.5: a query pre-scaled by this ratio gets query_scale
        self.q_ratio = query_scale * math.sqrt(spec.head_dim)
        q_out = spec.heads * spec.head_dim * (2 if gated else 1)
        self.q_proj = nn.Linear(spec.hidden, q_out, bias=False)
        self.k_proj = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)
        self.q_norm = OffsetRMSNorm(spec.head_dim, spec.rms_eps)
        self.k_norm = OffsetRMSNorm(spec.head_dim, spec.rms_eps)

    def _qkv(self, x: torch.Tensor, cos, sin):
        """x [n, E] -> q [n, H, D], k/v [n, KVH, D] (normed, rotated), gate [n, H*D] or None."""
        n, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(n, self.heads, -1)  # [n, H, D or 2D]
        gate = q[..., d:].reshape(n, self.heads * d) if self.gated else None
        q = self.q_norm(q[..., :d])
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, d))
        v = self.v_proj(x).view(n, self.kv_heads, d)
        q, k = rope_part(q, cos, sin), rope_part(k, cos, sin)
        if self.q_ratio != 1.0:
            q = q * self.q_ratio
        return q, k, v, gate

    def _out(self, out: torch.Tensor, gate) -> torch.Tensor:
        """out [n, H, D] -> gated (Qwen3.5) -> o_proj -> [n, E]."""
        out = out.reshape(out.shape[0], self.heads * self.head_dim)
        return self.o_proj(out * torch.sigmoid(gate) if self.gated else out)

    def forward(self, x, cos, sin, kv: KVStore, layer: int, start: int) -> torch.Tensor:
        q, k, v, gate = self._qkv(x, cos, sin)
        keys, values = kv.append(layer, start, torch.stack((k, v), dim=1))  # [KVH, start+n, D]
        return self._out(prefill_attention(q, keys, values, start, self.window), gate)

    def decode(self, x, cos, sin, kv: DecodeKV, layer: int, masks: tuple) -> torch.Tensor:
        """One new token per row of x [R, E] (padding rows included)."""
        q, k, v, gate = self._qkv(x, cos, sin)
        return self._out(kv.attend(layer, q, k, v, masks), gate)  # attend: [R, H * D]


class GatedMLP(nn.Module):
    """gate/up/down with the family's activation (SiLU, or Gemma's tanh-approximated GELU)."""

    def __init__(self, spec: ModelSpec, gelu: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden, spec.intermediate, bias=False)
        self.up_proj = nn.Linear(spec.hidden, spec.intermediate, bias=False)
        self.down_proj = nn.Linear(spec.intermediate, spec.hidden, bias=False)
        self.gelu = gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * self.up_proj(x))


class Qwen35Block(nn.Module):
    """Pre-norm block whose mixer is gated attention (full layers) or gated DeltaNet."""

    def __init__(self, spec: ModelSpec, arch: Arch, kind: str) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(spec.hidden, spec.rms_eps)
        self.linear = kind == "linear"
        if self.linear:
            self.linear_attn = GatedDeltaNet(spec.hidden, arch.linear, spec.rms_eps)
        else:
            self.self_attn = HybridAttention(spec, True, None, spec.head_dim ** -0.5)
        self.post_attention_layernorm = OffsetRMSNorm(spec.hidden, spec.rms_eps)
        self.mlp = GatedMLP(spec, gelu=False)

    def forward(self, h, cos, sin, kv, layer: int, start: int) -> torch.Tensor:
        x = self.input_layernorm(h)
        mixed = self.linear_attn(x, kv, layer) if self.linear else \
            self.self_attn(x, cos, sin, kv, layer, start)
        h = h + mixed
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode(self, h, cos, sin, kv, layer: int, masks: tuple) -> torch.Tensor:
        x = self.input_layernorm(h)
        mixed = self.linear_attn.decode(x, kv, layer) if self.linear else \
            self.self_attn.decode(x, cos, sin, kv, layer, masks)
        h = h + mixed
        return h + self.mlp(self.post_attention_layernorm(h))


class Gemma3Block(nn.Module):
    """Attention and MLP, each normalized before and after (sandwich norms)."""

    def __init__(self, spec: ModelSpec, arch: Arch, kind: str) -> None:
        super().__init__()
        window = arch.window if kind == "sliding" else None
        scale = spec.get("query_pre_attn_scalar") ** -0.5
        self.input_layernorm = OffsetRMSNorm(spec.hidden, spec.rms_eps)
        self.self_attn = HybridAttention(spec, False, window, scale)
        self.post_attention_layernorm = OffsetRMSNorm(spec.hidden, spec.rms_eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(spec.hidden, spec.rms_eps)
        self.mlp = GatedMLP(spec, gelu=True)
        self.post_feedforward_layernorm = OffsetRMSNorm(spec.hidden, spec.rms_eps)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(mlp)

    def forward(self, h, cos, sin, kv, layer: int, start: int) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin, kv, layer, start)
        return self._mlp(h + self.post_attention_layernorm(attn))

    def decode(self, h, cos, sin, kv, layer: int, masks: tuple) -> torch.Tensor:
        attn = self.self_attn.decode(self.input_layernorm(h), cos, sin, kv, layer, masks)
        return self._mlp(h + self.post_attention_layernorm(attn))


def hybrid_layers(spec: ModelSpec, arch: Arch) -> list[nn.Module]:
    """One block per layer of a hybrid family."""
    block = Qwen35Block if arch.family == "qwen3_5" else Gemma3Block
    return [block(spec, arch, kind) for kind in arch.kinds]
