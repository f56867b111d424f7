"""Model profiles: one TOML file per model in specs/models, shared by the simulator and the engine.

The file holds the architecture (enough to build the network in pdgpu) and the KV geometry
(all the protocol and the simulator need). `--model NAME` finds specs/models/NAME.toml;
`--model FILE.toml` takes a user's own file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import attrs

from pdref.geometry import Geometry
from pdref.kinds import FULL, LINEAR, SLIDING, LayerKind

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
MODELS_DIR = SPECS_DIR / "models"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ProfileError(ValueError):
    """A profile file is missing, unreadable or breaks a rule; the message names the field."""


@attrs.frozen
class RopeScaling:
    """Llama 3.1 style frequency scaling of RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@attrs.frozen
class ModelSpec:
    """A decoder-only transformer of the Qwen3 / Llama family, as a profile describes it."""

    name: str
    # qwen3_5 and gemma3: the engine's hybrid families (their layer kinds are in `extra`)
    arch: str = attrs.field(
        validator=attrs.validators.in_(("qwen3", "llama", "hybrid", "qwen3_5", "gemma3")))
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: str = attrs.field(validator=attrs.validators.in_(tuple(DTYPE_BYTES)))
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    recurrent: bool = False
    params: int | None = None
    # longest prompt + output the model was trained for (HF: max_position_embeddings);
    # None: not known (a user's own profile may leave it out), nothing is refused
    max_context: int | None = None
    rope_scaling: RopeScaling | None = None
    source: str = ""
    extra: tuple[tuple[str, object], ...] = ()

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def geometry(self, page_tokens: int = 16) -> Geometry:
        """The KV the handoff carries: of a hybrid, only its attention layers (`kv_layers`);
        (contract v3) with `layer_types`, every layer, each of its kind."""
        kinds = self.layer_kinds()
        return Geometry(
            layers=self.layers if kinds else (self.get("kv_layers") or self.layers),
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=self.dtype_bytes,
            page_tokens=page_tokens,
            recurrent=self.recurrent,
            kinds=kinds,
        )

    def layer_kinds(self) -> tuple[LayerKind, ...] | None:
        """(v3) Each layer's kind from the profile's `layer_types` (Hugging Face's names:
        full_attention, sliding_attention with `sliding_window`, linear_attention with
        `linear_state_bytes`, the state of one layer); None without `layer_types`."""
        types = self.get("layer_types")
        if types is None:
            return None
        if type(types) is not list or len(types) != self.layers:
            raise ValueError(f"field 'layer_types' must list {self.layers} layer types")
        made = {"full_attention": lambda: LayerKind(FULL),
                "sliding_attention": lambda: LayerKind(SLIDING, self.get("sliding_window")),
                "linear_attention": lambda: LayerKind(LINEAR, None,
                                                      self.get("linear_state_bytes"))}
        unknown = sorted(set(types) - set(made))
        if unknown:
            raise ValueError(f"field 'layer_types': unknown type {unknown[0]!r} (known: "
                             f"{', '.join(made)})")
        return tuple(made[t]() for t in types)

    def get(self, key: str, default=None):
        """A field of the profile that the spec does not name (e.g. simulator extras)."""
        return dict(self.extra).get(key, default)


_REQUIRED_INTS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")


def list_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.toml"))


def resolve_profile(name_or_path: str, folder: Path, what: str) -> Path:
    """The TOML file a name means: a shipped profile by name, or a path to a user's file."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        return path
    shipped = folder / f"{name_or_path}.toml"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in folder.glob("*.toml")))
    raise ProfileError(
        f"{what}: unknown profile {name_or_path!r} (known: {known}; or a .toml path)"
    )


def read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ProfileError(f"{path}: cannot read profile: {e}") from None


def load_model(name_or_path: str) -> ModelSpec:
    """Load and validate a model profile; raises ProfileError naming the bad field."""
    path = resolve_profile(name_or_path, MODELS_DIR, "model")
    data = read_toml(path)
    return model_from_dict(data, default_name=path.stem, where=str(path))


def model_from_dict(data: dict, default_name: str, where: str) -> ModelSpec:
    for key in _REQUIRED_INTS:
        value = data.get(key)
        if type(value) is not int or value < 1:
            raise ProfileError(f"{where}: field {key!r} must be an integer >= 1, got {value!r}")
    context = data.get("max_context")
    if context is not None and (type(context) is not int or context < 1):
        raise ProfileError(f"{where}: field 'max_context' must be an integer >= 1, "
                           f"got {context!r}")
    if data["heads"] % data["kv_heads"]:
        raise ProfileError(f"{where}: field 'heads' must be a multiple of 'kv_heads'")
    known = {f.name for f in attrs.fields(ModelSpec)}
    fields = {k: v for k, v in data.items() if k in known and k not in ("extra", "rope_scaling")}
    fields.setdefault("name", default_name)
    scaling = data.get("rope_scaling")
    extra = tuple(sorted((k, v) for k, v in data.items() if k not in known))
    try:
        rope = RopeScaling(**scaling) if scaling else None
        spec = ModelSpec(**fields, rope_scaling=rope, extra=extra)
        spec.geometry()  # (v3) its layer kinds agree with the rest
        return spec
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {e}") from None


def context_error(spec: ModelSpec, prompt: int, output: int, what: str = "prompt") -> str | None:
    """The one-line refusal of `prompt` + `output` tokens beyond the model's max_context, or
    None when they fit (or the limit is unknown). Callers raise it as their own bad input."""
    total = prompt + output
    if spec.max_context is None or total <= spec.max_context:
        return None
    return (f"{what}: prompt {prompt} + output {output} = {total} tokens exceed max_context "
            f"{spec.max_context} of model {spec.name!r} (prompt + output must be "
            f"<= max_context)")
