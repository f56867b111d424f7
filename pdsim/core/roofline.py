"""Roofline prices of one model's ops on one device under a roofline engine profile.

Every op takes the larger of its FLOPs at the engine's compute efficiency for its shape and
its bytes at the engine's memory efficiency:
    op_s = max(flops / (peak_flops x efficiency(shape)), bytes / (hbm_bandwidth x memory))
A forward pass (a prefill chunk, or a decode step over a batch) is the sum of its ops plus
the engine's overheads:
  - GEMMs: each weight matrix (N x K) over the pass's M rows (chunk tokens, or batch rows);
    efficiency = gemm(M) x dim(N) x dim(K), dim(d) = d (4096 + h) / (4096 (d + h)) with
    h = the engine's gemm_dim_half (a narrow matrix fills fewer SMs), bytes = the weights
    once per pass. So decode (M = batch) is memory-bound until M passes the chip's ridge
    point, prefill compute-bound.
  - each layer's token mixer, priced by its kind (MIXERS: one function per kind):
    full attention's prefill is FLOPs over the causal pairs at attention_prefill(context)
    against its KV read; its decode reads each row's KV (memory-bound);
  - overheads: chunk_s a prefill pass, decode_step_s a decode step, layer_s per layer of
    either (kernel launches an eager engine pays; a CUDA graph removes them from decode).
A decode step over `batch` rows reading `kv_tokens` KV tokens in all, `window_tokens` of
them windowed (each row's min(context, window), on the sliding layers), is
    decode_base_s(batch) + kv_tokens * kv_token_s + window_tokens * window_token_s
(linear in the KV read: the simulator's decoder keeps a batch's base while the KV grows).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs

from pdref.models import ModelSpec
from pdsim.core.engines import ArchFigures, EngineProfile

REFERENCE_DIM = 4096  # dim(d) = 1 at this width: the gemm table is for N, K >= 4096


def curve_at(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """The efficiency table's value at x: linear in log x between points, flat past the ends."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, e0), (x1, e1) in zip(curve, curve[1:], strict=False):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return e0 + w * (e1 - e0)
    return curve[-1][1]


@attrs.frozen
class Gemm:
    """One weight matrix (N outputs, K inputs) that `count` layers each apply."""

    n: int
    k: int
    count: int = 1


@attrs.frozen
class Roofline:
    """The per-op prices of one model on one device (peak, HBM) under one engine."""

    peak: float  # FLOP/s, dense, the model's dtype
    bandwidth: float  # HBM bytes/s
    figures: ArchFigures
    engine: EngineProfile
    spec: ModelSpec
    gemms: tuple[Gemm, ...]  # every layer's weights (a prefill pass)
    head: tuple[Gemm, ...]  # the LM head (a decode step's rows; prefill's is left out)
    mixers: tuple[tuple[str, int], ...]  # (layer kind, layers of it)

    def gemm_s(self, rows: int, g: Gemm) -> float:
        """One weight matrix over `rows` rows, every layer it is in."""
        eff = curve_at(self.figures.gemm, rows) * self._dim(g.n) * self._dim(g.k)
        flops = 2.0 * rows * g.n * g.k
        weights = g.n * g.k * self.spec.dtype_bytes
        return g.count * max(flops / (self.peak * eff),
                             weights / (self.bandwidth * self.figures.memory))

    def _dim(self, d: int) -> float:
        h = self.engine.gemm_dim_half
        return min(1.0, d * (REFERENCE_DIM + h) / (REFERENCE_DIM * (d + h)))

    def prefill_s(self, a: int, b: int) -> float:
        """One prefill pass over prompt positions [a, b), context [0, b)."""
        n = b - a
        if n <= 0:
            return self.engine.chunk_s
        linear = sum(self.gemm_s(n, g) for g in self.gemms)
        mixing = sum(count * MIXERS[kind].prefill(self, a, b) for kind, count in self.mixers)
        return self.engine.chunk_s + self.engine.layer_s * self.spec.layers + linear + mixing

    def decode_base_s(self, batch: int) -> float:
        """A decode step of `batch` rows, less its KV read (kv_token_s per token)."""
        if batch <= 0:
            return self.engine.decode_step_s
        linear = sum(self.gemm_s(batch, g) for g in self.gemms + self.head)
        rows = batch * sum(count * MIXERS[kind].decode_row(self) for kind, count in self.mixers)
        overhead = self.engine.decode_step_s + self.engine.layer_s * self.spec.layers
        return overhead + linear + rows

    @property
    def kv_token_s(self) -> float:
        """A decode step's time per KV token it reads, every layer."""
        return sum(count * MIXERS[kind].decode_kv_token(self) for kind, count in self.mixers)

    @property
    def window_token_s(self) -> float:
        """A decode step's time per windowed KV token it reads (a row's min(context,
        window)), every sliding layer."""
        return sum(count * MIXERS[kind].decode_window_token(self)
                   for kind, count in self.mixers)

    def scaled(self, compute: float) -> Roofline:
        """A what-if copy: compute speed (the peak) times `compute`; HBM unchanged."""
        return attrs.evolve(self, peak=self.peak * compute)


# -- token mixers by layer kind: one price per op, per layer --------------------------------

@attrs.frozen
class Mixer:
    """A layer kind's token mixer: prefill pass [a, b), a decode row's fixed part, a
    decode KV token read and a windowed KV token read; each the seconds of one layer."""

    prefill: Callable[[Roofline, int, int], float]
    decode_row: Callable[[Roofline], float]
    decode_kv_token: Callable[[Roofline], float]
    decode_window_token: Callable[[Roofline], float] = lambda r: 0.0


def _kv_bytes_layer(r: Roofline) -> int:
    return 2 * r.spec.kv_heads * r.spec.head_dim * r.spec.dtype_bytes


def attention_prefill_s(r: Roofline, a: int, b: int) -> float:
    """Causal attention of queries [a, b) over keys [0, b): QK^T and PV over the causal
    pairs (FlashAttention-class kernels skip masked tiles), against reading the KV once."""
    pairs = (b * (b + 1) - a * (a + 1)) // 2
    flops = 4.0 * r.spec.heads * r.spec.head_dim * pairs
    eff = curve_at(r.figures.attention_prefill, b)
    kv = b * _kv_bytes_layer(r)
    return max(flops / (r.peak * eff), kv / (r.bandwidth * r.figures.memory))


def attention_decode_kv_token_s(r: Roofline) -> float:
    """Decode attention reads each cached token's K and V once (paged kernel, memory-bound;
    its FLOPs, 4 x heads x head_dim a token, are far under the ridge point)."""
    return _kv_bytes_layer(r) / (r.bandwidth * r.figures.kv_memory)


def recurrent_prefill_s(r: Roofline, a: int, b: int) -> float:
    """A linear-attention (recurrent) layer over [a, b): its state read and written once,
    its per-token state update and readout (~4 FLOPs per state element) at the attention
    kernels' efficiency. A first estimate; contract-v3 prices hybrid kinds in detail."""
    state = _state_bytes_layer(r)
    flops = 4.0 * (b - a) * state / r.spec.dtype_bytes
    eff = curve_at(r.figures.attention_prefill, b)
    return max(flops / (r.peak * eff), 2 * state / (r.bandwidth * r.figures.memory))


def recurrent_decode_row_s(r: Roofline) -> float:
    """A decode row reads and writes its layer's recurrent state (memory-bound)."""
    return 2 * _state_bytes_layer(r) / (r.bandwidth * r.figures.kv_memory)


def _state_bytes_layer(r: Roofline) -> float:
    if r.spec.layer_kinds() is not None:  # (contract v3) the profile names one layer's state
        return float(r.spec.get("linear_state_bytes"))
    linear_layers = r.spec.layers - r.spec.geometry().layers
    return (r.spec.get("recurrent_state_bytes", 0) or 0) / max(linear_layers, 1)


def window_pairs(a: int, b: int, w: int) -> int:
    """(query, key) pairs of queries [a, b) in a window of `w`: query q attends its last
    min(q + 1, w) keys, itself included."""
    full = min(b, w)  # queries below w attend every key before them
    pairs = (max(0, full * (full + 1) - a * (a + 1)) // 2 if a < full else 0)
    return pairs + w * (b - max(a, full))


def sliding_prefill_s(r: Roofline, a: int, b: int) -> float:
    """Sliding-window attention of queries [a, b): query q attends its last W keys
    (min(q + 1, W) pairs), against reading those keys once; FlashAttention-class kernels
    skip the tiles outside the band, as they skip the masked ones."""
    w = r.spec.get("sliding_window")
    flops = 4.0 * r.spec.heads * r.spec.head_dim * window_pairs(a, b, w)
    eff = curve_at(r.figures.attention_prefill, min(b, w))
    kv = min(b, w - 1 + (b - a)) * _kv_bytes_layer(r)  # keys [a - w + 1, b)
    return max(flops / (r.peak * eff), kv / (r.bandwidth * r.figures.memory))


def sliding_decode_window_token_s(r: Roofline) -> float:
    """A decode row of a sliding layer reads the KV it holds, min(context, window) tokens
    (the decoder keeps only the window: a ring or freed pages), each as a full layer's."""
    return _kv_bytes_layer(r) / (r.bandwidth * r.figures.kv_memory)


MIXERS: dict[str, Mixer] = {
    "attention": Mixer(attention_prefill_s, lambda r: 0.0, attention_decode_kv_token_s),
    "recurrent": Mixer(recurrent_prefill_s, recurrent_decode_row_s, lambda r: 0.0),
    "sliding": Mixer(sliding_prefill_s, lambda r: 0.0, lambda r: 0.0,
                     sliding_decode_window_token_s),
}
_MIXER_OF_KIND = {"full": "attention", "sliding": "sliding", "linear": "recurrent"}


def layer_kinds(spec: ModelSpec) -> tuple[tuple[str, int], ...]:
    """(kind, count) of the model's token mixers: its KV layers are full attention, a
    hybrid's other layers recurrent (linear attention); (contract v3) a profile with
    `layer_types` counts each layer's own kind (full, sliding, linear)."""
    kinds = spec.layer_kinds()
    if kinds is not None:
        counts = {}
        for kind in kinds:
            name = _MIXER_OF_KIND[kind.kind]
            counts[name] = counts.get(name, 0) + 1
        return tuple(counts.items())
    attention = spec.geometry().layers
    rest = spec.layers - attention
    return (("attention", attention),) + ((("recurrent", rest),) if rest else ())


def model_gemms(spec: ModelSpec) -> tuple[tuple[Gemm, ...], tuple[Gemm, ...]]:
    """(every layer's weight matrices, the LM head's). A profile giving `active_params`
    (mixture of experts) is one matrix of that many weights, `hidden` wide."""
    h, hd, layers = spec.hidden, spec.head_dim, spec.layers
    head = (Gemm(spec.vocab, h),)
    active = spec.get("active_params")
    if active:
        return (Gemm(h, max(1, round(active / h))),), ()
    q, kv = spec.heads * hd, 2 * spec.kv_heads * hd
    return (Gemm(q + kv, h, layers), Gemm(h, q, layers),
            Gemm(2 * spec.intermediate, h, layers), Gemm(h, spec.intermediate, layers)), head


def roofline_for(spec: ModelSpec, peak: float, bandwidth: float, arch: str,
                 engine: EngineProfile) -> Roofline:
    gemms, head = model_gemms(spec)
    return Roofline(peak, bandwidth, engine.figures_for(arch), engine, spec, gemms, head,
                    layer_kinds(spec))
