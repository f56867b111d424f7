"""pdgpu.handoff: the v3 geometry of a model and the pieces `pdgpu run` moves for a span."""

from __future__ import annotations

import attrs
import pytest

from pdgpu.arch import arch_of
from pdgpu.handoff import ALIGN, KVPiece, StatePiece, handoff_geometry, pieces, staged
from pdref.models import load_model
from pdref.plan import plan_spans

TINY = attrs.evolve(load_model("tiny"), dtype="bfloat16")
# layers: linear linear full linear full (two runs of each kind); 3 linear, 2 K/V
QWEN35 = attrs.evolve(TINY, arch="qwen3_5", layers=5, recurrent=True, extra=(
    ("conv_kernel", 4), ("kv_layers", 2), ("linear_key_dim", 16), ("linear_key_heads", 2),
    ("linear_value_dim", 8), ("linear_value_heads", 3), ("rotary_dim", 8),
    ("layer_kinds", ("linear", "linear", "full", "linear", "full"))))
# layers: sliding sliding full sliding full
GEMMA3 = attrs.evolve(TINY, arch="gemma3", layers=5, extra=(
    ("kv_layers", 5), ("sliding_window", 20), ("local_rope_theta", 1e4),
    ("layer_kinds", ("sliding", "sliding", "full", "sliding", "full"))))


def test_a_dense_model_keeps_its_version_2_geometry():
    """A dense model's trace geometry has no kinds: a span is one block, its region."""
    geometry = handoff_geometry(TINY, 16)
    assert geometry == TINY.geometry(16) and geometry.kinds is None
    assert pieces(geometry, plan_spans("whole", geometry, 40, 0, 16)[0], 40, 0) == (
        KVPiece((0, TINY.layers), (0, 40)),)


def test_a_linear_layers_state_bytes_are_the_conv_window_and_recurrent_matrix():
    """state_bytes of a linear layer: conv [2*2*16 + 3*8, 3] in bfloat16 plus recurrent
    [3, 16, 8] in float32."""
    kinds = handoff_geometry(QWEN35, 16).kinds
    assert [k.kind for k in kinds] == ["linear", "linear", "full", "linear", "full"]
    assert kinds[0].state_bytes == (2 * 2 * 16 + 3 * 8) * 3 * 2 + 3 * 16 * 8 * 4


@pytest.mark.parametrize("spec", [QWEN35, GEMMA3], ids=["qwen3_5", "gemma3"])
@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
@pytest.mark.parametrize(("prompt", "prefix"), [(100, 0), (100, 32), (37, 0), (64, 64)])
def test_a_spans_pieces_move_exactly_its_bytes(spec, mode, prompt, prefix):
    """For every span of every mode the pieces' bytes sum to the span's `bytes` (v3 rules:
    window-cut sliding layers, no K/V of linear layers, the state of a state span), K/V
    pieces name K/V layers and state pieces linear layers (by their own numbering)."""
    geometry, arch = handoff_geometry(spec, 16), arch_of(spec)
    cell = geometry.bytes_per_token_layer
    for region in plan_spans(mode, geometry, prompt, prefix, 24):
        parts = pieces(geometry, region, prompt, prefix, (5, 7))
        assert sum(p.size(cell) for p in parts) == region.span_bytes(geometry, prompt, prefix)
        for part in parts:
            group = arch.linear_layers if isinstance(part, StatePiece) else arch.kv_layers
            assert 0 <= part.layers[0] < part.layers[1] <= len(group)
            assert isinstance(part, StatePiece) == region.state
        assert all((p.source_slot, p.slot) == (5, 7) for p in parts if region.state)


def test_a_sliding_layer_moves_only_its_window_from_a_page_start():
    """Gemma 3 (window 20, pages of 16), prompt 100: a chunk span over every layer moves
    every token of the full layers but only [80, 100) of the sliding ones (81 = 100 - 20 + 1
    starts on page 5, at 80); runs of equal tokens merge into one block."""
    geometry = handoff_geometry(GEMMA3, 16)
    region = plan_spans("chunk", geometry, 100, 0, 50)[1]  # tokens [50, 100)
    assert pieces(geometry, region, 100, 0) == (
        KVPiece((0, 2), (80, 100)), KVPiece((2, 3), (50, 100)), KVPiece((3, 4), (80, 100)),
        KVPiece((4, 5), (50, 100)))
    early = plan_spans("chunk", geometry, 100, 0, 50)[0]  # [0, 50): full layers only
    assert pieces(geometry, early, 100, 0) == (
        KVPiece((2, 3), (0, 50)), KVPiece((4, 5), (0, 50)))


def test_state_spans_map_model_layers_to_the_state_pools_numbering():
    """Qwen3.5 with linear layers 0, 1 and 3: whole mode's state spans read linear layers
    [0, 2) and [2, 3) of the pools; a piece is staged at an ALIGN-byte boundary."""
    geometry = handoff_geometry(QWEN35, 16)
    states = [r for r in plan_spans("whole", geometry, 40, 0, 16) if r.state]
    got = [pieces(geometry, r, 40, 0, (1, 2)) for r in states]
    per_layer = geometry.kinds[0].state_bytes
    assert got == [(StatePiece((0, 2), 1, 2, 2 * per_layer),),
                   (StatePiece((2, 3), 1, 2, per_layer),)]
    offsets, total = staged((KVPiece((0, 1), (0, 3)), got[0][0]), geometry.bytes_per_token_layer)
    assert offsets[1] % ALIGN == 0 and offsets[1] >= 3 * geometry.bytes_per_token_layer
    assert total >= offsets[1] + 2 * per_layer
