"""The vectorized draw of a batch's next tokens (the rules: sampling.py).

A batch of only greedy rows without penalties or bans is one argmax, as before sampling
existed. Otherwise the rows' options travel as one [B, 10] tensor (one host-to-device copy) and
every rule is a handful of whole-batch tensor ops; a row whose options leave a rule neutral
(top_k 0, top_p 1, no penalty) passes through it unchanged, bit for bit, so a row's token never
depends on which other rows share the batch. Nothing reads a device value back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pdgpu.sampling import Sampling, uniform

# the columns of a batch's option tensor
GREEDY, TEMPERATURE, TOP_P, TOP_K, MIN_P, PRESENCE, FREQUENCY, REPETITION, DRAW, SLOT = range(10)


class Step(NamedTuple):
    """One row of a batch's draw."""

    sampling: Sampling
    position: int  # output tokens before this one (0: the first, drawn by the producer)
    ban: tuple[int, ...] = ()  # tokens it may not draw now (stop tokens before min_tokens)
    slot: int = 0  # its row in the Sampler's penalty tables (0: none)

    @property
    def plain(self) -> bool:
        """Greedy with nothing to change its logits: the argmax."""
        return self.sampling.greedy and not self.sampling.penalized and not self.ban


class Sampler:
    """Draws a batch's tokens; keeps, for each request with penalties, its prompt's tokens (a
    mask) and its output's token counts, as rows of two [slots, V] tables (row 0: empty, the
    row of every request without penalties)."""

    def __init__(self, vocab: int, device) -> None:
        self.vocab, self.device = vocab, torch.device(device)
        self.prompt = torch.zeros((1, vocab), dtype=torch.bool, device=self.device)
        self.counts = torch.zeros((1, vocab), dtype=torch.float32, device=self.device)
        self.free: list[int] = []

    def open(self, sampling: Sampling, prompt, output: Sequence[int] = ()) -> int:
        """A request's slot (0 when it has no penalties), its prompt (ids or a tensor [n]) and
        output so far in it."""
        if not sampling.penalized:
            return 0
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.prompt[slot, torch.as_tensor(prompt, dtype=torch.int64, device=self.device)] = True
        for token in output:
            self.counts[slot, token] += 1
        return slot

    def close(self, slot: int) -> None:
        """The request ended: its slot is free (and empty) again."""
        if slot:
            self.prompt[slot] = False
            self.counts[slot] = 0
            self.free.append(slot)

    def _grow(self) -> None:
        rows = self.prompt.shape[0]
        self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.free.extend(range(2 * rows - 1, rows - 1, -1))

    @torch.no_grad()
    def pick(self, logits: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
        """logits [B, V] (row i: steps[i]) -> tokens [B] int64 on their device; the tokens of
        rows with penalties are counted in their slots."""
        if all(s.plain for s in steps):
            return logits.argmax(dim=-1)
        options = self._options(steps, logits.device)  # [B, 10]
        x = logits.float()  # [B, V]
        penalized = any(s.sampling.penalized for s in steps)
        slots = options[:, SLOT].long() if penalized else None  # [B]
        if penalized:
            x = self._penalize(x, slots, options)
        x = _ban(x, steps)
        sampled = [s.sampling for s in steps if not s.sampling.greedy]
        chosen = _draw(_kept(x, options, sampled), options[:, DRAW]) if sampled else None
        if len(sampled) < len(steps):  # greedy rows: the argmax
            greedy = x.argmax(dim=-1)
            chosen = greedy if chosen is None else torch.where(options[:, GREEDY] > 0, greedy,
                                                               chosen)
        if penalized:
            self.counts.index_put_((slots, chosen), (slots > 0).float(), accumulate=True)
        return chosen

    def draw(self, logits: torch.Tensor, steps: Sequence[Step]):
        """`pick`, and the rows' log-probabilities when a row asks for them (else None):
        -> (tokens [B], list of B Logprobs | None)."""
        tokens = self.pick(logits, steps)
        asked = [s.sampling.logprobs for s in steps if s.sampling.logprobs is not None]
        return tokens, (logprobs(logits, tokens, max(asked)) if asked else None)

    def _options(self, steps: Sequence[Step], device) -> torch.Tensor:
        rows = []
        for s in steps:
            o = s.sampling
            rows.append((float(o.greedy), o.temperature or 1.0, o.top_p, o.top_k or self.vocab,
                         o.min_p, o.presence_penalty, o.frequency_penalty,
                         o.repetition_penalty, uniform(o.seed, s.position), s.slot))
        return _host_to(rows, torch.float64, device)

    def _penalize(self, x: torch.Tensor, slots: torch.Tensor, options: torch.Tensor):
        """vLLM's repetition, frequency and presence penalties: x [B, V] -> [B, V]."""
        counts = self.counts[slots]  # [B, V]
        present = counts > 0
        repetition = options[:, REPETITION, None].float()  # [B, 1]
        scaled = torch.where(x > 0, x / repetition, x * repetition)
        x = torch.where(self.prompt[slots] | present, scaled, x)
        return x - options[:, FREQUENCY, None].float() * counts \
            - options[:, PRESENCE, None].float() * present


Logprobs = tuple[float, tuple[tuple[int, float], ...]]  # a token's, and the most likely ones


@torch.no_grad()
def logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[Logprobs]:
    """Each row's drawn token's log-probability and the `top` most likely (token, log-prob),
    from the model's own distribution (the raw logits, as vLLM's default `raw_logprobs`):
    logits [B, V], tokens [B] -> B entries."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()  # [B]
    if not top:
        return [(c, ()) for c in chosen]
    values, ids = logp.topk(top, dim=-1)  # [B, top] each
    return [(c, tuple(zip(i, v, strict=True)))
            for c, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)]


def _host_to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of Python values on `device`; to a GPU from pinned memory, so the copy is
    queued without waiting for the stream (a pageable one may wait for it)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _ban(x: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
    """Each row's banned tokens at -inf."""
    bans = [(row, token) for row, s in enumerate(steps) for token in s.ban]
    if not bans:
        return x
    rows, tokens = _host_to(bans, torch.int64, x.device).T  # [n] each
    return x.index_put((rows, tokens), x.new_full((), -torch.inf))


def _kept(x: torch.Tensor, options: torch.Tensor, sampled: list[Sampling]) -> torch.Tensor:
    """The probabilities each row may draw from (others 0): temperature, min_p, top_k, top_p
    -> [B, V] float32, not renormalized. A rule no sampled row uses is skipped (a row that
    does not use it passes through it unchanged either way)."""
    probs = torch.softmax(x / options[:, TEMPERATURE, None].float(), dim=-1)  # [B, V]
    if any(o.min_p > 0 for o in sampled):
        floor = options[:, MIN_P, None].float() * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        probs = torch.where(probs >= floor, probs, 0.0)
    if any(o.top_p < 1 for o in sampled):
        return _top_p(probs, options)
    most = max((o.top_k for o in sampled), default=0)
    if most:  # top_k alone: the k-th largest from a partial sort
        ranked = probs.topk(min(most, probs.shape[-1]), dim=-1).values  # [B, most]
        k = options[:, TOP_K, None]  # [B, 1]
        kth = ranked.gather(1, k.clamp(max=ranked.shape[-1]).long() - 1)
        probs = torch.where((probs >= kth) | (k > ranked.shape[-1]), probs, 0.0)
    return probs


def _top_p(probs: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
    """top_k then top_p over the sorted probabilities: probs [B, V] -> [B, V]."""
    ranked = probs.sort(dim=-1, descending=True).values  # [B, V] (values: ties are alike)
    kth = ranked.gather(1, options[:, TOP_K, None].long() - 1)  # [B, 1]
    ranked = torch.where(ranked >= kth, ranked, 0.0)
    before = ranked.cumsum(dim=-1) - ranked  # [B, V] the mass ranked above each token
    top_p = options[:, TOP_P, None].float()  # [B, 1]
    keep = (before < top_p * ranked.sum(dim=-1, keepdim=True)) | (top_p >= 1)
    last = ranked.gather(1, keep.sum(dim=-1, keepdim=True) - 1)  # [B, 1] the least kept
    return torch.where(probs >= torch.maximum(last, kth), probs, 0.0)


def _draw(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in vocabulary order: probs [B, V], draws [B] in [0, 1) -> tokens [B]. In
    float64, a draw times the total mass stays below the total (draws have 32 bits)."""
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    target = draws[:, None] * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1)
