"""The served model, by preset/profile name or Hugging Face checkpoint folder, on every rank."""

from __future__ import annotations

from pathlib import Path

import attrs

from pdgpu.checkpoint import inspect_checkpoint, load_checkpoint
from pdgpu.model import build_model
from pdref.models import ModelSpec, ProfileError, list_models, load_model

# the engine runs and serves these (the hybrids under contract v3: pdgpu/handoff.py)
ENGINE_ARCHS = ("qwen3", "llama", "qwen3_5", "gemma3")


def model_spec(model: str, dtype: str | None = None) -> ModelSpec:
    """The spec from a preset, a profile or a checkpoint's headers (nothing allocated)."""
    _check_exists(model)
    spec = inspect_checkpoint(model) if Path(model).is_dir() else load_model(model)
    return attrs.evolve(spec, dtype=dtype) if dtype else spec


def _check_exists(model: str) -> None:
    """A `--model` written as a path (a folder separator, or a leading . or ~) that names
    nothing is said to be missing, not an unknown preset."""
    if ("/" in model or model.startswith((".", "~"))) and not Path(model).exists():
        raise ProfileError(f"model: {model} does not exist (a checkpoint folder with "
                           "config.json and *.safetensors, a .toml profile, or a preset: "
                           f"{', '.join(list_models())})")


def load_served_model(model: str, seed: int, dtype: str | None, device: str = "cpu"):
    """The network: a checkpoint's weights, or a preset's seeded random weights."""
    if Path(model).is_dir():
        return load_checkpoint(model, device, dtype)
    return build_model(model_spec(model, dtype), device=device, seed=seed)
