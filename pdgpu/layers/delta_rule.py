"""The gated delta rule (Gated DeltaNet's linear attention), in its two forms, in float32.

Per value head, a state S [Dk, Dv] is decayed, corrected and read at every token t:
    S <- S * exp(g_t)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T        (the delta rule: write only the error)
    o_t = S^T q_t
with q and k L2-normalized and q scaled by Dk^-0.5.

`chunked` runs a prefill chunk of n tokens in blocks of BLOCK (the WY/UT form: a block's
updates condensed into a triangular solve and a few matmuls), starting from the state the
previous chunk left; `recurrent` runs one token per row of a decode batch. Both are the math
of transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

BLOCK = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def prepare(q: torch.Tensor, k: torch.Tensor, value_heads: int):
    """q/k [..., Hk, Dk] -> float32, L2-normalized, q scaled, each key head repeated for
    the value heads it serves -> [..., Hv, Dk]."""
    groups = value_heads // q.shape[-2]
    q, k = _l2norm(q.float()), _l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    return q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)


def chunked(q, k, v, g, beta, state: torch.Tensor):
    """q/k [H, n, Dk], v [H, n, Dv], g/beta [H, n] (float32), state [H, Dk, Dv] (float32)
    -> (out [H, n, Dv], the state after the last token)."""
    heads, n, _ = k.shape
    pad = (BLOCK - n % BLOCK) % BLOCK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))  # [H, N, D], N = n + pad
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))  # [H, N]
    blocks = (n + pad) // BLOCK
    q, k, v = (x.view(heads, blocks, BLOCK, -1) for x in (q, k, v))  # [H, b, T, D]
    k_beta, v_beta = k * beta.view(heads, blocks, BLOCK, 1), v * beta.view(heads, blocks,
                                                                            BLOCK, 1)
    decay = g.view(heads, blocks, BLOCK).cumsum(dim=-1)  # [H, b, T] log decay since block start
    future = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair  # [H, b, T, T] lower triangle
    inner = (q @ k.transpose(-1, -2)) * pair  # [H, b, T, T] in-block attention
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None],
                                              upper=False, unitriangular=True)  # [H, b, T, Dk]
    q = q * decay.exp()[..., None]  # decay from block start applied once
    k = k * (decay[..., -1:] - decay).exp()[..., None]  # decay to block end
    block_decay = decay[..., -1].exp()[..., None, None]  # [H, b, 1, 1]
    out = torch.empty_like(new_v)  # [H, b, T, Dv]
    for i in range(blocks):
        fresh = new_v[:, i] - k_decayed[:, i] @ state  # [H, T, Dv] what the state misses
        out[:, i] = q[:, i] @ state + inner[:, i] @ fresh
        state = state * block_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh  # [H, Dk, Dv]
    return out.reshape(heads, -1, out.shape[-1])[:, :n], state


def recurrent(q, k, v, g, beta, state: torch.Tensor):
    """One token per row: q/k [B, H, Dk], v [B, H, Dv], g/beta [B, H] (float32), state
    [B, H, Dk, Dv] -> (out [B, H, Dv], the new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # [B, H, Dv]
    delta = (v - remembered) * beta[..., None]  # [B, H, Dv]
    state = state + k[..., None] * delta[..., None, :]  # [B, H, Dk, Dv]
    return (state * q[..., None]).sum(dim=-2), state
