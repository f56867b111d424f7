"""The cost model: a small set of named linear terms, derived from a model and hardware profile.

compute(chunk [a, b))  = chunk_s + token_s * (b - a) + pair_s * sum_{i=a}^{b-1} (i + 1)
                         + window_pair_s * sum_{i=a}^{b-1} min(i + 1, window)
  with dense_attention: pair_s * n * b instead (an engine that runs a chunk's attention as
  a dense masked n x b rectangle pays for the masked-out pairs too; calibrated profiles only)
  (contract v3) pair_s covers the full-attention layers, window_pair_s the sliding ones, and
  token_s a linear layer's state update too (~4 FLOPs per state element per token)
copy(span of n bytes)  = span_s + gather_byte_s * n + link_latency_s + link_byte_s * n
  (one span alone; how spans share the copier, serial or pipelined: pdsim/core/copier.py)
head (the first token's LM head, after the last chunk) = head_s (calibrated profiles only)
first token's messages (serving: the prefill order out, the token back) = serve_latency_s, a
  delay before the decoder has the token: no core, no producer held (calibrated profiles)
fill (export only: writing the payload of n bytes) = fill_byte_s * n (calibrated profiles only)
decode step (batch B, KV tokens K read) = decode_s + decode_row_s * B + decode_kv_token_s * K
                                        + decode_window_token_s * Kw
  derived when a profile lacks them: the weights read once per step at HBM bandwidth, a
  row's matmul FLOPs at the compute rate, a KV token's bytes (every full-attention layer)
  at HBM bandwidth; (v3) a row also reads and writes its linear layers' states, and its
  sliding layers read the KV they hold: Kw = sum over rows of min(context, window)
  (decode_window_token_s: a token's KV bytes on every sliding layer, at HBM bandwidth)
between decode steps the decoder's loop works decode_gap_s, plus land_byte_s per byte of a
  span it lands and admit_byte_s per KV byte of a context it admits (profile [compute]
  values; absent: 0, not modeled)
While a gather overlaps a compute chunk, the chunk runs slower by `contention` times the
overlapped time. With `[compute] host_cores` (one host's CPU cores shared by the producers'
prefill and the decoder's steps), those run processor-shared, and each span's landing adds
land_contention * its bytes to the prefill running then (pdsim/core/cores.py).
`pdsim calibrate` fits these same terms from engine traces.

These are the linear cost model (an engine profile's `cost_model = "linear"`: `seed-eager`
and calibrated profiles). Under a roofline engine (`production`) a prefill chunk and a decode
step's base come from `roofline` (pdsim/core/roofline.py): each op the larger of its FLOPs
and its bytes at the engine's efficiencies; the copy terms are the same.
"""

from __future__ import annotations

from collections import Counter

import attrs

from pdref.geometry import Geometry
from pdref.kinds import FULL, LINEAR, SLIDING
from pdref.models import ModelSpec
from pdsim.core.engines import DEFAULT_ENGINE, EngineProfile, load_engine
from pdsim.core.profile_fields import COPIERS, non_negative
from pdsim.core.profiles import HwProfile, LinkProfile
from pdsim.core.roofline import Roofline, roofline_for, window_pairs


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
    # (v3) per windowed KV token: a row holds min(context, window) on each sliding layer
    decode_window_token_s: float = attrs.field(default=0.0, validator=non_negative)
    # The decoder's own work between steps (pdgpu serve's loop): per step, per landed byte
    # written into its slab, per KV byte of an admitted context copied to its decode cache.
    decode_gap_s: float = attrs.field(default=0.0, validator=non_negative)
    land_byte_s: float = attrs.field(default=0.0, validator=non_negative)
    admit_byte_s: float = attrs.field(default=0.0, validator=non_negative)
    head_s: float = attrs.field(default=0.0, validator=non_negative)  # first token's LM head
    serve_latency_s: float = attrs.field(default=0.0, validator=non_negative)
    dense_attention: bool = False  # pairs of a chunk [a, b): n * b, not the causal triangle
    # (v3) the sliding layers' window (0: none) and their attention, per windowed pair
    window: int = 0
    window_pair_s: float = attrs.field(default=0.0, validator=non_negative)
    state_bytes: int = 0
    fill_byte_s: float = attrs.field(default=0.0, validator=non_negative)
    # Cores shared by every producer's compute and the decoder's steps (None: dedicated
    # devices, nothing shared; pdsim/core/cores.py)
    host_cores: float | None = None
    # with host_cores: seconds per byte landed that every prefill running then loses (cores.py)
    land_contention: float = attrs.field(default=0.0, validator=non_negative)
    # A roofline engine's op prices: prefill chunks and decode steps' bases from it (then
    # token_s, pair_s, chunk_s, decode_s and decode_row_s are 0: not its terms)
    roofline: Roofline | None = None

    @property
    def link_byte_s(self) -> float:
        per_byte = [s for _, s in self.link_stages]
        return max(per_byte) if self.streamed else sum(per_byte)

    def compute_s(self, tokens: tuple[int, int]) -> float:
        """Time of one prefill chunk over prompt positions [a, b), with context [0, b)."""
        a, b = tokens
        if self.roofline is not None:
            return self.roofline.prefill_s(a, b)
        n = max(b - a, 0)
        pairs = attention_pairs(a, b, self.dense_attention)
        seconds = self.chunk_s + self.token_s * n + self.pair_s * pairs
        if self.window and n:
            seconds += self.window_pair_s * window_pairs(a, b, self.window)
        return seconds

    def decode_base_s(self, batch: int) -> float:
        """A decode step of `batch` rows less its KV read (decode_kv_token_s per token,
        decode_window_token_s per windowed token)."""
        if self.roofline is not None:
            return self.roofline.decode_base_s(batch)
        return self.decode_s + batch * self.decode_row_s

    def decode_step_s(self, contexts) -> float:
        """One decode step over rows holding `contexts` tokens each (the decoder keeps the
        sums as they grow: decoder.py)."""
        windowed = sum(min(c, self.window) for c in contexts)
        return (self.decode_base_s(len(contexts)) + sum(contexts) * self.decode_kv_token_s
                + windowed * self.decode_window_token_s)

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
            window_pair_s=self.window_pair_s / compute,
            decode_row_s=self.decode_row_s / compute,
            gather_byte_s=self.gather_byte_s / bandwidth,
            link_stages=tuple((n, s / bandwidth) for n, s in self.link_stages),
            roofline=None if self.roofline is None else self.roofline.scaled(compute),
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


@attrs.frozen
class MixerLayers:
    """How many layers mix tokens each way: full attention (a model without `layer_types`:
    every KV layer), (v3) sliding-window attention and linear attention, with the window
    and one linear layer's state bytes."""

    full: int
    sliding: int = 0
    linear: int = 0
    window: int = 0
    state_bytes: int = 0


def mixer_layers(spec: ModelSpec) -> MixerLayers:
    kinds = spec.layer_kinds()
    if kinds is None:
        return MixerLayers(sim_geometry(spec).layers)
    count = Counter(k.kind for k in kinds)
    return MixerLayers(count[FULL], count[SLIDING], count[LINEAR],
                       spec.get("sliding_window") or 0, spec.get("linear_state_bytes") or 0)


def pair_flops(spec: ModelSpec, layers: int | None = None) -> float:
    """Attention FLOPs per (query token, context token) pair: QK^T and PV, over `layers`
    (None: every full-attention layer)."""
    layers = mixer_layers(spec).full if layers is None else layers
    return 4.0 * layers * spec.heads * spec.head_dim


def state_flops_per_token(spec: ModelSpec) -> float:
    """(v3) A prompt token's linear-attention state updates and readouts: ~4 FLOPs per state
    element of every linear layer (as roofline.recurrent_prefill_s)."""
    mix = mixer_layers(spec)
    return 4.0 * mix.linear * mix.state_bytes / spec.dtype_bytes


def state_row_bytes(spec: ModelSpec) -> int:
    """(v3) HBM bytes a decode row moves for its linear layers: each one's state read and
    written (its sliding layers' KV is priced per windowed token: decode_window_token_s)."""
    mix = mixer_layers(spec)
    return mix.linear * 2 * mix.state_bytes


def engine_of(hw: HwProfile, name: str | None = None) -> EngineProfile:
    """The engine a run uses: `name` if given; else a calibrated hw profile's own (fitted
    with its device); else the default, the production-class profile."""
    if name is not None:
        return load_engine(name)
    return hw.engine if hw.engine is not None else load_engine(DEFAULT_ENGINE)


def costs_for(spec: ModelSpec, hw: HwProfile, link: LinkProfile,
              engine: EngineProfile) -> Costs:
    """The cost terms of `spec` on `hw` over `link` under `engine`."""
    copy = dict(span_s=engine.span_s, gather_byte_s=1.0 / engine.gather_rate(hw.hbm_bandwidth),
                link_stages=tuple((s.name, 1.0 / s.bandwidth) for s in link.stages),
                link_latency_s=link.latency_s, streamed=link.pipelined, copier=engine.copier,
                fill_byte_s=engine.fill_byte_s, contention=engine.contention)
    if engine.cost_model == "roofline":
        roofline = roofline_for(spec, hw.peak_flops, hw.hbm_bandwidth, hw.arch, engine)
        return Costs(token_s=0.0, pair_s=0.0, chunk_s=0.0, **copy,
                     decode_kv_token_s=roofline.kv_token_s,
                     window=mixer_layers(spec).window,
                     decode_window_token_s=roofline.window_token_s,
                     decode_token_s=roofline.decode_base_s(1),  # a lone request's step
                     state_bytes=int(spec.get("recurrent_state_bytes", 0) or 0),
                     roofline=roofline)
    return _linear_costs(spec, hw, engine, copy)


def _linear_costs(spec: ModelSpec, hw: HwProfile, engine: EngineProfile, copy: dict) -> Costs:
    """The linear cost model: FLOP-derived terms at peak x efficiency, fitted ones winning."""
    rate = hw.peak_flops * engine.efficiency
    over = engine.compute
    weights = linear_flops_per_token(spec) / 2 * spec.dtype_bytes
    decode = decode_terms(spec, hw, engine)
    token_flops = linear_flops_per_token(spec) + state_flops_per_token(spec)
    return Costs(
        token_s=over.token_s if over.token_s is not None else token_flops / rate,
        pair_s=over.pair_s if over.pair_s is not None else pair_flops(spec) / rate,
        chunk_s=over.chunk_s if over.chunk_s is not None else engine.chunk_s,
        **copy,
        **_window_terms(spec, hw, engine),
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


def _window_terms(spec: ModelSpec, hw: HwProfile, engine: EngineProfile) -> dict:
    """(v3) The sliding layers' window, their price per windowed prefill pair and per
    windowed decode token; neither beside its fitted term (a calibration's pair_s, or
    decode_row_s, already holds whatever attention it measured)."""
    mix = mixer_layers(spec)
    if not mix.sliding:
        return {}
    over, terms = engine.compute, {"window": mix.window}
    if over.pair_s is None:
        rate = hw.peak_flops * engine.efficiency
        terms["window_pair_s"] = pair_flops(spec, mix.sliding) / rate
    if over.decode_row_s is None:
        kv_token = mix.sliding * sim_geometry(spec).bytes_per_token_layer
        terms["decode_window_token_s"] = kv_token / hw.hbm_bandwidth
    return terms


def decode_terms(spec: ModelSpec, hw: HwProfile, engine: EngineProfile) -> dict[str, float]:
    """The decode step's terms: the engine's own (fitted), else derived (not measured): a
    step reads the weights once (HBM), each row costs its matmul FLOPs (and, v3, its linear
    states' bytes), each KV token read its bytes on the full-attention layers (a windowed
    token's on the sliding ones: _window_terms); added, not overlapped (the linear model)."""
    kv_layer = sim_geometry(spec).bytes_per_token_layer
    derived = {
        "decode_s": linear_flops_per_token(spec) / 2 * spec.dtype_bytes / hw.hbm_bandwidth,
        "decode_row_s": linear_flops_per_token(spec) / (hw.peak_flops * engine.efficiency)
        + state_row_bytes(spec) / hw.hbm_bandwidth,
        "decode_kv_token_s": kv_layer * mixer_layers(spec).full / hw.hbm_bandwidth,
    }
    return {name: derived[name] if getattr(engine.compute, name) is None
            else getattr(engine.compute, name) for name in derived}
