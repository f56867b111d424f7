"""Gated DeltaNet, Qwen3.5's linear-attention layer, over a per-request state.

A layer keeps no K/V. Per request it keeps a state of fixed size in a state pool's slot
(state_pool.py): `conv` [C, K-1], the last K-1 inputs of its causal depthwise convolution
(the model's dtype), and `recurrent` [Hv, Dk, Dv], the delta rule's matrix per value head
(float32). A prefill chunk reads both and leaves them as they are after its last token, so
the next chunk (or the first decode step) continues exactly where it stopped; prefill uses
the delta rule's chunked form, decode its recurrent form (delta_rule.py).

Module names follow transformers' Qwen3_5GatedDeltaNet (`linear_attn.in_proj_qkv`, ...).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from pdgpu.arch import LinearShape
from pdgpu.layers import delta_rule
from pdgpu.layers.norms import GatedRMSNorm


class PrefillState(Protocol):
    """The request's state of linear layer `layer`: views updated in place."""

    def states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecodeState(Protocol):
    """A decode batch's states of linear layer `layer`: one read and one write per layer."""

    def read_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_states(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None: ...


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, shape: LinearShape, eps: float) -> None:
        super().__init__()
        self.shape = shape
        s, c = shape, shape.conv_dim
        self.in_proj_qkv = nn.Linear(hidden, c, bias=False)
        self.in_proj_z = nn.Linear(hidden, s.value_heads * s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, s.value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, s.value_heads, bias=False)
        self.conv1d = nn.Conv1d(c, c, s.conv_kernel, groups=c, bias=False)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(s.value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.value_heads))
        self.norm = GatedRMSNorm(s.value_dim, eps)
        self.out_proj = nn.Linear(s.value_heads * s.value_dim, hidden, bias=False)

    def _split(self, mixed: torch.Tensor):
        """Conv output [..., C] -> q/k [..., Hk, Dk] and v [..., Hv, Dv]."""
        s = self.shape
        q, k, v = mixed.split([s.key_heads * s.key_dim] * 2 + [s.value_heads * s.value_dim], -1)
        lead = mixed.shape[:-1]
        return (q.reshape(*lead, s.key_heads, s.key_dim), k.reshape(*lead, s.key_heads, s.key_dim),
                v.reshape(*lead, s.value_heads, s.value_dim))

    def _gates(self, x: torch.Tensor):
        """x [..., E] -> decay g (log space, <= 0) and write strength beta [..., Hv], float32."""
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        return g, self.in_proj_b(x).sigmoid().float()

    def _out(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """core [..., Hv, Dv] (float32) -> gated norm, output projection -> [..., E]."""
        s = self.shape
        z = self.in_proj_z(x).view(*x.shape[:-1], s.value_heads, s.value_dim)
        out = self.norm(core.to(x.dtype), z)  # [..., Hv, Dv]
        return self.out_proj(out.reshape(*x.shape[:-1], s.value_heads * s.value_dim))

    def forward(self, x: torch.Tensor, store: PrefillState, layer: int) -> torch.Tensor:
        """A prefill chunk x [n, E], continuing the request's state -> [n, E]."""
        n = x.shape[0]
        conv_state, state = store.states(layer)  # [C, K-1], [Hv, Dk, Dv]
        window = torch.cat((conv_state, self.in_proj_qkv(x).transpose(0, 1)), dim=1)  # [C, K-1+n]
        mixed = F.silu(F.conv1d(window[None], self.conv1d.weight, groups=window.shape[0]))
        conv_state.copy_(window[:, n:])  # the last K-1 inputs
        q, k, v = self._split(mixed[0].transpose(0, 1))  # [n, Hk, Dk] x2, [n, Hv, Dv]
        q, k = delta_rule.prepare(q, k, self.shape.value_heads)  # [n, Hv, Dk]
        g, beta = self._gates(x)  # [n, Hv]
        core, last = delta_rule.chunked(q.transpose(0, 1), k.transpose(0, 1),
                                        v.float().transpose(0, 1), g.T, beta.T, state)
        state.copy_(last)
        return self._out(core.transpose(0, 1), x)  # [n, E]

    def decode(self, x: torch.Tensor, store: DecodeState, layer: int) -> torch.Tensor:
        """One token per row of x [R, E], every row with a state (a padding row's is the
        decode cache's scratch slot): its bits do not depend on the batch."""
        conv_state, state = store.read_states(layer)  # [R, C, K-1], [R, Hv, Dk, Dv]
        mixed = self.in_proj_qkv(x)  # [R, C]
        window = torch.cat((conv_state, mixed[:, :, None]), dim=2)  # [R, C, K]
        conved = F.silu((window * self.conv1d.weight[:, 0]).sum(dim=-1))  # [R, C]
        q, k, v = self._split(conved)  # [R, Hk, Dk] x2, [R, Hv, Dv]
        q, k = delta_rule.prepare(q, k, self.shape.value_heads)  # [R, Hv, Dk]
        g, beta = self._gates(x)  # [R, Hv]
        core, state = delta_rule.recurrent(q, k, v.float(), g, beta, state)
        store.write_states(layer, window[:, :, 1:], state)
        return self._out(core, x)  # [R, E]
