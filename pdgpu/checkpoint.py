"""Load a local Hugging Face-layout checkpoint: config.json + *.safetensors (never pickle).

Every tensor's presence and shape is checked against the config from the safetensors
headers alone, before the model is allocated; a bad checkpoint raises CheckpointError with
one line naming the file and the tensor or key.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
from safetensors import safe_open

from pdgpu.hf_config import CheckpointError, hf_config, spec_from_config
from pdgpu.model import Transformer, build_model, fuse_weights
from pdref.models import ModelSpec

__all__ = ["CheckpointError", "hf_config", "inspect_checkpoint", "load_checkpoint",
           "save_checkpoint", "spec_from_config"]


IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read config ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config must be a JSON object")
    return config


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape the checkpoint must hold (HF names)."""
    with torch.device("meta"):
        model = Transformer(spec)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _headers(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) from the safetensors headers (no tensor data is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    found[key] = (path, tuple(f.get_slice(key).get_shape()))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    return found


def check_head_dim(spec: ModelSpec, found: dict, where: str) -> None:
    """A head_dim the query projection contradicts is named as such, not as a bad tensor."""
    if Q_PROJ not in found:
        return
    rows = found[Q_PROJ][1][0]
    gates = 2 if spec.arch == "qwen3_5" else 1  # Qwen3.5's full layers: queries and gates
    if rows != gates * spec.heads * spec.head_dim:
        raise CheckpointError(f"{where}: field 'head_dim' {spec.head_dim} contradicts "
                              f"{Q_PROJ} with {rows} rows ({spec.heads} heads)")


def check_tensors(spec: ModelSpec, found: dict, folder: Path) -> None:
    """Raise for the first missing, misshapen or unexpected tensor."""
    want = expected_shapes(spec)
    for name, shape in want.items():
        if name not in found:
            raise CheckpointError(f"{folder}: missing tensor {name} {list(shape)}")
        if found[name][1] != shape:
            raise CheckpointError(f"{found[name][0]}: tensor {name} has shape "
                                  f"{list(found[name][1])}, expected {list(shape)}")
    extra = [n for n in found if n not in want and not _ignorable(n, spec)]
    if extra:
        raise CheckpointError(f"{found[extra[0]][0]}: unexpected tensor {extra[0]}")


def _ignorable(name: str, spec: ModelSpec) -> bool:
    tied_head = spec.tie_embeddings and name == "lm_head.weight"
    return tied_head or name.endswith(IGNORED_SUFFIXES)


def inspect_checkpoint(folder: str | Path) -> ModelSpec:
    """The checkpoint's ModelSpec after checking config and every tensor header."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    where = str(folder / "config.json")
    spec = spec_from_config(_read_config(folder), folder.name, where)
    found = _headers(folder)
    check_head_dim(spec, found, where)
    check_tensors(spec, found, folder)
    return spec


def load_checkpoint(folder: str | Path, device="cpu", dtype: str | None = None) -> Transformer:
    """Validate the checkpoint, then build the model (in `dtype` if given) and load it."""
    spec = inspect_checkpoint(folder)
    if dtype is not None:
        spec = attrs.evolve(spec, dtype=dtype)
    model = build_model(spec, device=device, seed=None)
    _load_tensors(model, _headers(Path(folder)))
    fuse_weights(model)  # the q/k norm table is a copy of the loaded norms
    return model


@torch.no_grad()
def _load_tensors(model: Transformer, found: dict) -> None:
    state = model.state_dict()
    by_file: dict[Path, list[str]] = {}
    for name in state:
        by_file.setdefault(found[name][0], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                state[name].copy_(f.get_tensor(name))


def save_checkpoint(model: Transformer, folder: str | Path) -> None:
    """Write `model` as an HF-layout checkpoint (used by tests and for round trips)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(model.spec), indent=1))
    # copies: q/k/v and gate/up are views of one fused matrix each, and safetensors refuses
    # tensors that share memory
    tensors = {k: v.clone(memory_format=torch.contiguous_format)
               for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))

