"""KV geometry: how many bytes a (layers x tokens) region of KV cache occupies, and (v3) each
layer's kind."""

from __future__ import annotations

import attrs

from pdref.intervals import Range, length
from pdref.kinds import LINEAR, LayerKind, Layout


def _positive(_inst, attribute, value) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def _kinds(value) -> tuple[LayerKind, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen
class Geometry:
    """The KV layout the handoff protocol needs: layer count, per-token KV width, page size,
    and (v3) the kind of every layer (None: every layer is `full`, as in versions 1 and 2)."""

    layers: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    dtype_bytes: int = attrs.field(validator=_positive)
    page_tokens: int = attrs.field(default=16, validator=_positive)
    recurrent: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    kinds: tuple[LayerKind, ...] | None = attrs.field(default=None, converter=_kinds)
    # the kinds as runs, for the per-kind checks (None for a geometry without kinds)
    layout: Layout | None = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        layout = None
        if self.kinds is not None:
            if len(self.kinds) != self.layers:
                raise ValueError(f"kinds names {len(self.kinds)} layers, the geometry has "
                                 f"{self.layers}")
            linear = any(k.kind == LINEAR for k in self.kinds)
            if linear != self.recurrent:
                raise ValueError(f"recurrent must be {str(linear).lower()} when "
                                 f"{'a' if linear else 'no'} layer is linear")
            layout = Layout(self.kinds)
        object.__setattr__(self, "layout", layout)

    @property
    def bytes_per_token_layer(self) -> int:
        # K and V, every KV head, every channel.
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_layer * self.layers

    def region_bytes(self, layers: Range, tokens: Range) -> int:
        """KV bytes of the region layers x tokens (0 when either range is empty), every
        layer counted as full."""
        return self.bytes_per_token_layer * length(layers) * length(tokens)

    def span_bytes(self, layers: Range, tokens: Range, prompt: int, prefix: int) -> int:
        """(v3) The bytes a KV span over the region moves for a request of `prompt` tokens
        and `prefix` cached ones: per kind (kinds.Layout.kv_cells); `region_bytes` without
        kinds."""
        if self.layout is None:
            return self.region_bytes(layers, tokens)
        return self.bytes_per_token_layer * self.layout.kv_cells(layers, tokens, prompt, prefix,
                                                                 self.page_tokens)

    def state_bytes(self, layers: Range) -> int:
        """(v3) The bytes of a state span over `layers` (0 without kinds)."""
        return 0 if self.layout is None else self.layout.state_bytes(layers)

    def pages_for(self, num_tokens: int) -> int:
        """Pages a slab needs to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_tokens)

    def to_json(self) -> dict:
        out = {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
               "dtype_bytes": self.dtype_bytes, "page_tokens": self.page_tokens,
               "recurrent": self.recurrent}
        if self.kinds is not None:
            out["kinds"] = [k.to_json() for k in self.kinds]
        return out
