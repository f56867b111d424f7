"""The cost model: a small set of named linear terms, derived from a model and hardware profile.

compute(chunk [a, b))  = chunk_s + token_s * (b - a) + pair_s * sum_{i=a}^{b-1} (i + 1)
  with dense_attention: pair_s * n * b instead (an engine that runs a chunk's attention as
  a dense masked n x b rectangle pays for the masked-out pairs too; calibrated profiles only)
copy(span of n bytes)  = span_s + gather_byte_s * n + link_latency_s + link_byte_s * n
  (one span alone; how spans share the copier, serial or pipelined: pdsim/core/copier.py)
head (the first token's LM head, after the last chunk) = head_s (calibrated profiles only)
first token's messages (serving: the prefill order out, the token back) = serve_latency_s, a
  delay before the decoder has the token: no core, no producer held (calibrated profiles)
fill (export only: writing the payload of n bytes) = fill_byte_s * n (calibrated profiles only)
decode step (batch B, KV tokens K read) = decode_s + decode_row_s * B + decode_kv_token_s * K
  derived when a profile lacks them: the weights read once per step at HBM bandwidth, a
  row's matmul FLOPs at the compute rate, a KV token's bytes (every layer) at HBM bandwidth
between decode steps the decoder's loop works decode_gap_s, plus land_byte_s per byte of a
  span it lands and admit_byte_s per KV byte of a context it admits (profile [compute]
  values; absent: 0, not modeled)
While a gather overlaps a compute chunk, the chunk runs slower by `contention` times the
overlapped time. With `[compute] host_cores` (one host's CPU cores shared by the producers'
prefill and the decoder's steps), those run processor-shared, and each span's landing adds
land_contention * its bytes to the prefill running then (pdsim/core/cores.py).
`pdsim calibrate` fits these same terms from engine traces.
"""

from __future__ import annotations

import attrs

from pdref.geometry import Geometry
from pdref.models import ModelSpec
from pdsim.core.profiles import COPIERS, HwProfile, LinkProfile, non_negative


@attrs.frozen
class Costs:
    """Every timing term the simulator uses, in seconds (per item, per byte or per pair)."""

    token_s: float = attrs.field(validator=non_negative)
    pair_s: float = attrs.field(validator=non_negative)
    chunk_s: float = attrs.field(validator=non_negative)
    span_s: float = attrs.field(validator=non_negative)
    gather_byte_s: float = attrs.field(validator=non_negative)
    link_stages: tuple[tuple[str, float], ...]  # (stage name, seconds per byte)
    link_latency_s: float = attrs.field(validator=non_negative)
    streamed: bool = True  # a span's link stages overlap (the link profile's `pipelined`)
    copier: str = attrs.field(default="serial", validator=attrs.validators.in_(COPIERS))
    contention: float = attrs.field(default=0.0, validator=non_negative)
    # the producer's copy stages whose time slows compute they overlap (`contention`)
    contended: tuple[str, ...] = ("gather",)
    decode_token_s: float = attrs.field(default=0.0, validator=non_negative)
    decode_s: float = attrs.field(default=0.0, validator=non_negative)  # a decode step's own
    decode_row_s: float = attrs.field(default=0.0, validator=non_negative)  # per request
    decode_kv_token_s: float = attrs.field(default=0.0, validator=non_negative)  # per KV token
    # The decoder's own work between steps (pdgpu serve's loop): per step, per landed byte
    # written into its slab, per KV byte of an admitted context copied to its decode cache.
    decode_gap_s: float = attrs.field(default=0.0, validator=non_negative)
    land_byte_s: float = attrs.field(default=0.0, validator=non_negative)
    admit_byte_s: float = attrs.field(default=0.0, validator=non_negative)
    head_s: float = attrs.field(default=0.0, validator=non_negative)  # first token's LM head
    serve_latency_s: float = attrs.field(default=0.0, validator=non_negative)
    dense_attention: bool = False  # pairs of a chunk [a, b): n * b, not the causal triangle
    state_bytes: int = 0
    fill_byte_s: float = attrs.field(default=0.0, validator=non_negative)
    # Cores shared by every producer's compute and the decoder's steps (None: dedicated
    # devices, nothing shared; pdsim/core/cores.py)
    host_cores: float | None = None
    # with host_cores: seconds per byte landed that every prefill running then loses (cores.py)
    land_contention: float = attrs.field(default=0.0, validator=non_negative)

    @property
    def link_byte_s(self) -> float:
        per_byte = [s for _, s in self.link_stages]
        return max(per_byte) if self.streamed else sum(per_byte)

    def compute_s(self, tokens: tuple[int, int]) -> float:
        """Time of one prefill chunk over prompt positions [a, b), with context [0, b)."""
        a, b = tokens
        n = max(b - a, 0)
        pairs = attention_pairs(a, b, self.dense_attention)
        return self.chunk_s + self.token_s * n + self.pair_s * pairs

    def gather_s(self, nbytes: int) -> float:
        return self.gather_byte_s * nbytes

    def link_s(self, nbytes: int) -> float:
        return self.link_latency_s + self.link_byte_s * nbytes

    def copy_s(self, nbytes: int) -> float:
        """Time of one span's copy alone: fixed cost, gather, then the link."""
        return self.span_s + self.gather_s(nbytes) + self.link_s(nbytes)

    def stage_plan(self, nbytes: int) -> list[tuple[str, float, float]]:
        """(name, start offset, end offset) of a span's stages, relative to its start, on
        a copier with nothing else in flight."""
        g0 = self.span_s
        g1 = g0 + self.gather_s(nbytes)
        plan = [("gather", g0, g1)]
        t = g1 + self.link_latency_s
        for name, per_byte in self.link_stages:
            plan.append((name, t, t + per_byte * nbytes))
            if not self.streamed:
                t += per_byte * nbytes
        return plan

    def scaled(self, bandwidth: float = 1.0, compute: float = 1.0) -> Costs:
        """A what-if copy: every bandwidth times `bandwidth`, compute speed times `compute`."""
        return attrs.evolve(
            self,
            token_s=self.token_s / compute,
            pair_s=self.pair_s / compute,
            decode_row_s=self.decode_row_s / compute,
            gather_byte_s=self.gather_byte_s / bandwidth,
            link_stages=tuple((n, s / bandwidth) for n, s in self.link_stages),
        )


def attention_pairs(a: int, b: int, dense: bool = False) -> int:
    """(query, key) pairs of a chunk [a, b) over context [0, b): causal triangle or rectangle."""
    n = max(b - a, 0)
    if not n:
        return 0
    return n * b if dense else (b * (b + 1) - a * (a + 1)) // 2


def sim_geometry(spec: ModelSpec, page_tokens: int = 16) -> Geometry:
    """The KV geometry the handoff carries: only attention layers (`kv_layers`) of a hybrid."""
    return spec.geometry(page_tokens)


def linear_flops_per_token(spec: ModelSpec) -> float:
    """Matmul FLOPs per prompt token: 2 x the non-embedding parameters a token touches."""
    active = spec.get("active_params")
    if active:
        return 2.0 * active
    if spec.params:
        embed = spec.vocab * spec.hidden * (1 if spec.tie_embeddings else 2)
        return 2.0 * (spec.params - embed)
    attn = spec.hidden * spec.head_dim * (2 * spec.heads + 2 * spec.kv_heads)
    return 2.0 * spec.layers * (attn + 3 * spec.hidden * spec.intermediate)


def pair_flops(spec: ModelSpec) -> float:
    """Attention FLOPs per (query token, context token) pair: QK^T and PV, every KV layer."""
    return 4.0 * sim_geometry(spec).layers * spec.heads * spec.head_dim


def costs_for(spec: ModelSpec, hw: HwProfile, link: LinkProfile) -> Costs:
    """Derive the cost terms of `spec` on `hw` over `link` (explicit overrides win)."""
    rate = hw.peak_flops * hw.efficiency
    over = hw.compute
    weights = linear_flops_per_token(spec) / 2 * spec.dtype_bytes
    decode = decode_terms(spec, hw)
    return Costs(
        token_s=over.token_s if over.token_s is not None else linear_flops_per_token(spec) / rate,
        pair_s=over.pair_s if over.pair_s is not None else pair_flops(spec) / rate,
        chunk_s=over.chunk_s if over.chunk_s is not None else hw.chunk_s,
        span_s=hw.span_s,
        gather_byte_s=1.0 / hw.gather_bandwidth,
        link_stages=tuple((s.name, 1.0 / s.bandwidth) for s in link.stages),
        link_latency_s=link.latency_s,
        streamed=link.pipelined,
        copier=hw.copier,
        fill_byte_s=hw.fill_byte_s,
        contention=hw.contention,
        decode_token_s=weights / hw.hbm_bandwidth,
        **decode,
        decode_gap_s=over.decode_gap_s or 0.0,
        land_byte_s=over.land_byte_s or 0.0,
        admit_byte_s=over.admit_byte_s or 0.0,
        state_bytes=int(spec.get("recurrent_state_bytes", 0) or 0),
        head_s=over.head_s or 0.0,  # shipped GPU profiles: absorbed in their efficiency
        serve_latency_s=over.serve_latency_s or 0.0,
        dense_attention=bool(over.dense_attention),
        host_cores=over.host_cores,
        land_contention=over.land_contention or 0.0,
    )


def decode_terms(spec: ModelSpec, hw: HwProfile) -> dict[str, float]:
    """The decode step's terms: the profile's own, else derived (not measured): a step reads
    the weights once (HBM), each row costs its matmul FLOPs, each KV token read its bytes."""
    derived = {
        "decode_s": linear_flops_per_token(spec) / 2 * spec.dtype_bytes / hw.hbm_bandwidth,
        "decode_row_s": linear_flops_per_token(spec) / (hw.peak_flops * hw.efficiency),
        "decode_kv_token_s": sim_geometry(spec).bytes_per_token / hw.hbm_bandwidth,
    }
    return {name: derived[name] if getattr(hw.compute, name) is None
            else getattr(hw.compute, name) for name in derived}
