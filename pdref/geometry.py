"""KV geometry: how many bytes a (layers x tokens) region of KV cache occupies."""

from __future__ import annotations

import attrs

from pdref.intervals import Range, length


def _positive(_inst, attribute, value) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


@attrs.frozen
class Geometry:
    """The KV layout the handoff protocol needs: layer count, per-token KV width, page size."""

    layers: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    dtype_bytes: int = attrs.field(validator=_positive)
    page_tokens: int = attrs.field(default=16, validator=_positive)
    recurrent: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @property
    def bytes_per_token_layer(self) -> int:
        # K and V, every KV head, every channel.
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_layer * self.layers

    def region_bytes(self, layers: Range, tokens: Range) -> int:
        """KV bytes of the region layers x tokens (0 when either range is empty)."""
        return self.bytes_per_token_layer * length(layers) * length(tokens)

    def pages_for(self, num_tokens: int) -> int:
        """Pages a slab needs to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_tokens)

    def to_json(self) -> dict:
        return attrs.asdict(self)
