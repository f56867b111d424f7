"""A hybrid model's all-full twin: the same model with every layer full attention, what a
hybrid's layer kinds are measured against (`pdsim study-hybrid`). `NAME+full` names the twin
of preset or profile NAME wherever a study takes a model."""

from __future__ import annotations

import attrs

from pdref.models import ModelSpec, load_model

ALL_FULL = "+full"  # a model name's suffix: that model with every layer full attention


def all_full(spec: ModelSpec) -> ModelSpec:
    """`spec` with every layer full attention (its v3 layer kinds dropped): what a hybrid's
    handoff and compute would be without its linear and sliding layers."""
    dropped = ("layer_types", "sliding_window", "linear_state_bytes")
    return attrs.evolve(spec, name=spec.name + ALL_FULL, recurrent=False,
                        extra=tuple((k, v) for k, v in spec.extra if k not in dropped))


def model_or_twin(name: str) -> ModelSpec:
    """A preset or profile file; NAME+full: its all-full twin (`all_full`)."""
    if name.endswith(ALL_FULL):
        return all_full(load_model(name.removesuffix(ALL_FULL)))
    return load_model(name)
