"""What admitting a request into decode memory should copy, from the model's preset alone
(not the engine's code): shared by the serving decoder's and `pdgpu run`'s admission tests."""

from __future__ import annotations

from pdref.models import load_model


def context_bytes(preset: str, prompt: int) -> int:
    """A context's K/V bytes once, from the preset's layer kinds: a full layer every token,
    a sliding one its last window, a linear one none (float32)."""
    spec = load_model(preset)
    extra = dict(spec.extra)
    kinds = extra.get("layer_kinds", ["full"] * spec.layers)
    window = extra.get("sliding_window")
    tokens = sum(prompt if k == "full" else min(prompt, window) for k in kinds if k != "linear")
    return tokens * 2 * spec.kv_heads * spec.head_dim * 4
