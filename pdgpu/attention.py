"""The engine's attention kernels: prefill over a request's contiguous K/V, decode in buckets.

Prefill. A chunk of n queries at positions [start, start + n) attends keys [0, start + n):
every earlier key, and the chunk's own keys causally (a *lower-right* causal mask). No mask
tensor is built and K/V are never repeated for GQA (`enable_gqa`):
  start == 0  torch SDPA with `is_causal` (flash on CUDA and on CPU)
  CUDA        torch SDPA with `causal_lower_right` (flash's causal is lower-right)
  CPU         two flash calls, the earlier keys unmasked and the chunk's own keys causal
              (square: upper-left = lower-right), merged by their log-sum-exp. torch's CPU
              SDPA has no lower-right flash path: it would build the [n, start + n] mask
              and run the math kernel (3x slower at 2048 tokens in chunks of 256).
float32 on CUDA with grouped K/V is the exception: no fused kernel takes it, so K/V are
repeated per query head for the memory-efficient kernel (tests/test_pdgpu_attention.py runs
it with only that kernel enabled), rather than leave torch to the math kernel.
A sliding-window layer (`window` W: a query at p sees keys (p - W, p]) whose chunk reaches
past the first W positions attends only the keys its chunk can see, under a band mask.

Decode. One query per request over its own length. A batch is split into groups whose K/V
rows all have the same width (a power of two, decode_kv.py); each group is one SDPA call over
q [b, KVH, G, D] and k/v [b, KVH, W, D] with an additive length mask made once a step.
A request's arithmetic depends only on its own width, never on who else is in the batch:
the same bits alone (`pdgpu generate`) as in any batch (tests/test_pdgpu_attention.py).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.nn.attention.bias import causal_lower_right

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                      window: int | None = None) -> torch.Tensor:
    """q [n, H, D] at positions [start, start + n); k/v [KVH, start + n, D] -> [n, H, D]."""
    n = q.shape[0]
    if window is not None and start + n > window:
        return _windowed(q, k, v, start, window)
    qh, kh, vh = q.transpose(0, 1)[None], k[None], v[None]  # [1, H, n, D], [1, KVH, c, D]
    gqa = not _no_fused_gqa(q, k)
    if not gqa:
        kh, vh = _repeat_heads(kh, q.shape[1]), _repeat_heads(vh, q.shape[1])  # [1, H, c, D]
    if start == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    elif q.device.type == "cpu":
        out = _split_causal_cpu(qh, kh, vh, start)
    else:
        bias = causal_lower_right(n, k.shape[1])
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, enable_gqa=gqa)
    return out[0].transpose(0, 1)  # [n, H, D]


def _no_fused_gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """float32 grouped-query attention on CUDA: flash refuses float32 and memory-efficient
    refuses fewer K/V heads than query heads (torch 2.11..2.13), so torch would build the mask
    and run the math kernel (scores materialized, K/V repeated anyway)."""
    return q.device.type == "cuda" and q.dtype == torch.float32 and k.shape[0] != q.shape[1]


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, KVH, c, D] -> [1, H, c, D], each K/V head repeated for its query group: memory-
    efficient attention then runs it (c x D per query head; no [n, c] scores or mask)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _windowed(q, k, v, start: int, window: int) -> torch.Tensor:
    """q [n, H, D] at [start, start + n) over the keys of the last `window` positions of each
    query (k/v [KVH, start + n, D]) -> [n, H, D]."""
    end = k.shape[1]
    first = max(0, start - window + 1)  # the oldest key any query of the chunk sees
    queries = torch.arange(start, end, device=q.device)[:, None]  # [n, 1]
    keys = torch.arange(first, end, device=q.device)[None, :]  # [1, c]
    band = (keys <= queries) & (keys > queries - window)  # [n, c] True: attended
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None, :, first:],
                                         v[None, :, first:], attn_mask=band, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, H, D]


def _split_causal_cpu(q, k, v, start: int) -> torch.Tensor:
    """q [1, H, n, D] over k/v [1, KVH, start + n, D]: earlier keys in full, own keys causal,
    merged in three ops: own's share of the total weight is sigmoid(own_lse - old_lse)."""
    own, own_lse = _cpu_flash(q, k[:, :, start:], v[:, :, start:], 0.0, True)[:2]
    old, old_lse = _cpu_flash(q, k[:, :, :start], v[:, :, :start], 0.0, False)[:2]
    share = torch.sigmoid(own_lse - old_lse)[..., None]  # [1, H, n, 1] float32
    if q.dtype == torch.float32:
        return torch.lerp(old, own, share)  # [1, H, n, D]
    return torch.lerp(old.float(), own.float(), share).to(q.dtype)


def key_bias(positions: torch.Tensor, columns: torch.Tensor, dtype) -> torch.Tensor:
    """The additive mask of rows whose new token sits at positions [b]: 0 for keys
    [0, position], -inf past it -> [b, 1, 1, W] (columns: arange(W)). The same for every
    layer of a decode step, so it is made once a step."""
    past = columns[None, :] > positions[:, None]  # [b, W]
    return past.to(dtype).masked_fill_(past, float("-inf"))[:, None, None]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """q [b, H, D]; k/v [b, KVH, W, D]; bias [b, 1, 1, W] from key_bias -> [b, KVH, G, D]
    (G = H / KVH: a view of [b, H, D], whose memory is [b, G, KVH, D]).

    A group's G query heads are SDPA's query positions over their KV head's keys, so no
    `enable_gqa` is needed (CUDA's memory-efficient kernel refuses it, which would send it
    to the math kernel with K/V repeated). Keys past a row's length must be finite."""
    b, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    qg = q.view(b, kv_heads, heads // kv_heads, head_dim)  # [b, KVH, G, D]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=bias)  # [b, KVH, G, D]
