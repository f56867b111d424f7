"""What a model's layers are, per family: the one place the engine asks "which kind is layer l".

Dense families (qwen3, llama): every layer is `full` attention. The hybrids (hf_hybrid.py
reads their config.json into the spec's extras) mix three kinds:
  full     attention over every earlier token; K/V kept per token (pages, decode buckets)
  sliding  attention over the last `window` tokens only (Gemma 3); K/V per token in prefill,
           a ring of `window` rows per request in decode
  linear   gated DeltaNet (Qwen3.5): no K/V, a fixed-size state per request (a conv window
           and a recurrent matrix per value head), kept in a state pool's slot
K/V layers (full and sliding) are numbered among themselves (`kv_index`), as the handoff's
geometry counts them; linear layers among themselves (`state_index`).
"""

from __future__ import annotations

import attrs

from pdref.models import ModelSpec

DENSE = ("qwen3", "llama")
HYBRID = ("qwen3_5", "gemma3")


@attrs.frozen
class LinearShape:
    """A gated DeltaNet layer's sizes (Qwen3.5's linear_* fields)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@attrs.frozen
class Arch:
    """The per-layer structure of a spec."""

    family: str
    kinds: tuple[str, ...]
    rotary_dim: int
    window: int | None = None  # sliding layers' window (tokens, the query's own included)
    local_rope_theta: float | None = None  # sliding layers' RoPE base (Gemma 3)
    linear: LinearShape | None = None

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The model layers that keep K/V, in order (kv index i is model layer kv_layers[i])."""
        return tuple(i for i, k in enumerate(self.kinds) if k != "linear")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == "linear")

    def store_index(self, layer: int) -> int:
        """Layer `layer`'s index among the layers of its storage (K/V or state)."""
        group = self.linear_layers if self.kinds[layer] == "linear" else self.kv_layers
        return group.index(layer)

    @property
    def kv_windows(self) -> tuple[int | None, ...]:
        """Per K/V layer: its window (sliding) or None (full)."""
        return tuple(self.window if self.kinds[i] == "sliding" else None for i in self.kv_layers)


def arch_of(spec: ModelSpec) -> Arch:
    """The layer structure of a spec (a dense family's: every layer full, whole-head RoPE)."""
    if spec.arch in DENSE:
        return Arch(spec.arch, ("full",) * spec.layers, spec.head_dim)
    if spec.arch not in HYBRID:
        raise ValueError(f"model: arch {spec.arch!r} has no engine implementation "
                         "(qwen3, llama, qwen3_5, gemma3)")
    kinds = tuple(_extra(spec, "layer_kinds"))
    if len(kinds) != spec.layers:
        raise ValueError(f"model {spec.name!r}: 'layer_kinds' has {len(kinds)} entries for "
                         f"{spec.layers} layers")
    if spec.arch == "gemma3":
        return Arch("gemma3", kinds, spec.head_dim, window=_extra(spec, "sliding_window"),
                    local_rope_theta=_extra(spec, "local_rope_theta"))
    linear = LinearShape(*(_extra(spec, k) for k in ("linear_key_heads", "linear_value_heads",
                                                      "linear_key_dim", "linear_value_dim",
                                                      "conv_kernel")))
    return Arch("qwen3_5", kinds, _extra(spec, "rotary_dim"), linear=linear)


def _extra(spec: ModelSpec, key: str):
    value = spec.get(key)
    if value is None:
        raise ValueError(f"model {spec.name!r}: missing field {key!r} ({spec.arch})")
    return value
