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

from pdgpu.model import Transformer, build_model
from pdref.models import ModelSpec, ProfileError, RopeScaling, model_from_dict

ARCHS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; one line naming what is wrong."""


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read config ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config must be a JSON object")
    return config


def _arch(config: dict, where: str) -> str:
    archs = config.get("architectures") or []
    known = [ARCHS[a] for a in archs if a in ARCHS]
    if not archs and config.get("model_type") in ARCHS.values():
        known = [config["model_type"]]
    if not known:
        raise CheckpointError(f"{where}: unknown architecture {archs!r} "
                              f"(supported: {', '.join(ARCHS)})")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise CheckpointError(f"{where}: attention_bias / mlp_bias are not supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act must be silu, got {act!r}")
    return known[0]


def _rope_scaling(config: dict, where: str) -> RopeScaling | None:
    s = config.get("rope_scaling")
    if not s:
        return None
    if s.get("rope_type", s.get("type")) != "llama3":
        raise CheckpointError(f"{where}: rope_scaling type {s.get('rope_type')!r} is not "
                              "supported (only llama3)")
    return RopeScaling(float(s["factor"]), float(s["low_freq_factor"]),
                       float(s["high_freq_factor"]), int(s["original_max_position_embeddings"]))


def spec_from_config(config: dict, name: str, where: str) -> ModelSpec:
    """The ModelSpec a Hugging Face config.json describes."""
    arch = _arch(config, where)
    heads = config.get("num_attention_heads")
    fields = {
        "name": name, "arch": arch, "layers": config.get("num_hidden_layers"),
        "hidden": config.get("hidden_size"), "heads": heads,
        "kv_heads": config.get("num_key_value_heads", heads),
        "head_dim": config.get("head_dim") or _div(config.get("hidden_size"), heads),
        "intermediate": config.get("intermediate_size"), "vocab": config.get("vocab_size"),
        "dtype": DTYPES.get(config.get("torch_dtype", config.get("dtype")), "float32"),
        "rope_theta": float(config.get("rope_theta", 10000.0)),
        "rms_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }
    try:
        spec = model_from_dict(fields, default_name=name, where=where)
    except (ProfileError, KeyError, TypeError) as e:
        raise CheckpointError(str(e)) from None
    return attrs.evolve(spec, rope_scaling=_rope_scaling(config, where))


def _div(a, b):
    return a // b if isinstance(a, int) and isinstance(b, int) and b else None


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
    spec = spec_from_config(_read_config(folder), folder.name, str(folder / "config.json"))
    check_tensors(spec, _headers(folder), folder)
    return spec


def load_checkpoint(folder: str | Path, device="cpu", dtype: str | None = None) -> Transformer:
    """Validate the checkpoint, then build the model (in `dtype` if given) and load it."""
    spec = inspect_checkpoint(folder)
    if dtype is not None:
        spec = attrs.evolve(spec, dtype=dtype)
    model = build_model(spec, device=device, seed=None)
    _load_tensors(model, _headers(Path(folder)))
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
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))


def hf_config(spec: ModelSpec) -> dict:
    """The Hugging Face config.json of a spec."""
    config = {
        "architectures": [{v: k for k, v in ARCHS.items()}[spec.arch]],
        "model_type": spec.arch,
        "num_hidden_layers": spec.layers, "hidden_size": spec.hidden,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim, "intermediate_size": spec.intermediate,
        "vocab_size": spec.vocab, "torch_dtype": spec.dtype, "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_eps, "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False,
    }
    s = spec.rope_scaling
    if s is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position}
    return config
