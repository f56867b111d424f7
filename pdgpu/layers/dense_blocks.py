"""The dense families' layers (Qwen3 / Llama): RMSNorm, grouped-query attention, the SwiGLU
MLP and the pre-norm block that holds them, each over prefill chunks and decode rows.

Few kernels per layer (on a GPU each op is a launch): `fuse_weights` (run at load time)
lays q/k/v out as one matrix and gate/up as another, the HF-named weights becoming views of
them (no memory is doubled and a checkpoint still loads into the HF names), so a layer makes
one qkv and one gate-up product; the output and down products accumulate onto the residual
stream in the same op (`add_linear`); every norm is torch's `rms_norm` (one kernel on CUDA); q and
k are normed and rotated together; K and V reach the cache as one tensor. tests/
test_pdgpu_op_count.py holds the counts (pdgpu/op_count.py counts them).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdgpu.attention import prefill_attention
from pdgpu.layers.kv_ports import DecodeKV, KVStore
from pdgpu.layers.rope import apply_rope
from pdref.models import ModelSpec


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension: torch's `rms_norm` (one fused kernel on CUDA)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention; q/k/v run as one product over `qkv_weight` (fuse_weights)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden, spec.kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)
        self.qk_norm = spec.arch == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_eps)
        self.eps = spec.rms_eps

    @torch.no_grad()
    def fuse(self) -> None:
        """Lay q/k/v out as one matrix [(H + 2 KVH) * D, E], the HF weights becoming views of
        it, and the q/k norm weights as one table [H + KVH, D] (a copy: run after loading)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        self.register_buffer("qkv_weight", torch.cat([p.weight for p in parts]), persistent=False)
        _share_rows(self.qkv_weight, parts)
        if self.qk_norm:
            table = torch.cat((self.q_norm.weight.expand(self.heads, -1),
                               self.k_norm.weight.expand(self.kv_heads, -1)))
            self.register_buffer("qk_norm_weight", table, persistent=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [n, E] -> q [n, H, D] and k [n, KVH, D] normed and rotated, v [n, KVH, D]."""
        n, heads, kv_heads, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv_weight)  # [n, (H + 2 KVH) * D]
        qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)  # [n, H + KVH, D]
        if self.qk_norm:  # one norm over every q and k head, then each head kind's weight
            qk = F.rms_norm(qk, (d,), None, self.eps) * self.qk_norm_weight
        qk = apply_rope(qk, cos, sin)  # [n, H + KVH, D]
        v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)  # [n, KVH, D]
        return qk[:, :heads], qk[:, heads:], v

    def forward(self, x, cos, sin, kv: KVStore, layer: int, start: int,
                residual: torch.Tensor) -> torch.Tensor:
        """residual [n, E] + attention of x [n, E] at positions [start, start + n)."""
        n = x.shape[0]
        q, k, v = self.project(x, cos, sin)
        keys, values = kv.append(layer, start, torch.stack((k, v), dim=1))  # [KVH, start+n, D]
        out = prefill_attention(q, keys, values, start)  # [n, H, D]
        return add_linear(residual, out.reshape(n, self.heads * self.head_dim), self.o_proj)

    def decode(self, x, cos, sin, kv: DecodeKV, layer: int, masks: tuple,
               residual: torch.Tensor) -> torch.Tensor:
        """residual [R, E] + attention of one new token per row of x [R, E] (padding rows
        included)."""
        q, k, v = self.project(x, cos, sin)
        return add_linear(residual, kv.attend(layer, q, k, v, masks), self.o_proj)


class MLP(nn.Module):
    """SwiGLU; gate and up run as one product over `gate_up_weight` (fuse_weights)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden, spec.intermediate, bias=False)
        self.up_proj = nn.Linear(spec.hidden, spec.intermediate, bias=False)
        self.down_proj = nn.Linear(spec.intermediate, spec.hidden, bias=False)

    @torch.no_grad()
    def fuse(self) -> None:
        parts = (self.gate_proj, self.up_proj)
        weight = torch.cat([p.weight for p in parts])  # [2I, E]
        self.register_buffer("gate_up_weight", weight, persistent=False)
        _share_rows(self.gate_up_weight, parts)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual [n, E] + the MLP of x [n, E]."""
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)  # [n, I] each (views)
        return add_linear(residual, F.silu(gate) * up, self.down_proj)


def add_linear(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """residual + linear(x) as one op (a product accumulated onto the residual stream):
    residual [n, E], x [n, K] -> [n, E]."""
    return torch.addmm(residual, x, linear.weight.t())


def _share_rows(fused: torch.Tensor, linears) -> None:
    """Make each Linear's weight a view of its rows of `fused` (loading into the HF names
    then writes the fused matrix)."""
    row = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[row:row + rows], requires_grad=False)
        row += rows


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden, spec.rms_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.rms_eps)
        self.mlp = MLP(spec)

    def forward(self, h, cos, sin, kv: KVStore, layer: int, start: int) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(h), cos, sin, kv, layer, start, residual=h)
        return self.mlp(self.post_attention_layernorm(h), residual=h)

    def decode(self, h, cos, sin, kv: DecodeKV, layer: int, masks: tuple) -> torch.Tensor:
        h = self.self_attn.decode(self.input_layernorm(h), cos, sin, kv, layer, masks,
                                  residual=h)
        return self.mlp(self.post_attention_layernorm(h), residual=h)
