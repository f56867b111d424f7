"""The K/V a request decodes with: its prompt's K/V, then one row per generated token.

At admission the request's context (prefix cache + the slab its spans landed in, or a
single-process prefill) is copied once into a tensor sized for prompt + output tokens, so each
decode step appends one row in place and attends over a view. `DecodeBatch` is the model's
`DecodeKV` for a batch of such requests.
"""

from __future__ import annotations

import torch


class SequenceKV:
    """K/V [L, 2, capacity, KVH, D] of one request; rows [0, length) hold its tokens so far."""

    def __init__(self, context: torch.Tensor, capacity: int) -> None:
        layers, two, length, kv_heads, head_dim = context.shape  # [L, 2, c, KVH, D]
        if capacity < length:
            raise ValueError(f"capacity {capacity} is below the context's {length} tokens")
        self.kv = torch.empty((layers, two, capacity, kv_heads, head_dim), dtype=context.dtype,
                              device=context.device)
        self.kv[:, :, :length] = context
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class DecodeBatch:
    """The running requests of one decode step, in batch-row order."""

    def __init__(self, seqs: list[SequenceKV]) -> None:
        self.seqs = seqs

    def positions(self, device) -> torch.Tensor:
        """Where each row's new token sits: its request's current length -> [B]."""
        return torch.tensor([s.length for s in self.seqs], dtype=torch.int64, device=device)

    def append_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store row i's k/v [KVH, D] at its request's next position; (K, V) [c_i, KVH, D]."""
        out = []
        for i, seq in enumerate(self.seqs):
            seq.kv[layer, 0, seq.length] = k[i]
            seq.kv[layer, 1, seq.length] = v[i]
            end = seq.length + 1
            out.append((seq.kv[layer, 0, :end], seq.kv[layer, 1, :end]))
        return out

    def advance(self) -> None:
        """After a step: every request holds one more token."""
        for seq in self.seqs:
            seq.length += 1


@torch.no_grad()
def decode_tokens(model, batch: DecodeBatch, tokens: list[int]) -> list[int]:
    """One greedy step: feed each request's last token, get its next token."""
    device = model.inv_freq.device
    inputs = torch.tensor(tokens, dtype=torch.int64, device=device)  # [B]
    logits = model.decode_step(inputs, batch.positions(device), batch)  # [B, V]
    batch.advance()
    return logits.argmax(dim=-1).tolist()
