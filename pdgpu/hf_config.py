"""Read a Hugging Face config.json (transformers 4 or 5 layout) into a ModelSpec, strictly.

transformers 4 writes `rope_theta`, `rope_scaling` and `torch_dtype` at the top level;
transformers 5 writes `rope_parameters` (theta, rope type, llama3 scaling fields) and
`dtype`. Both are read. No field that changes the math is ever defaulted: a missing,
contradictory or unsupported value raises CheckpointError naming the field.
"""

from __future__ import annotations

import attrs

from pdgpu.hf_hybrid import hybrid_fields
from pdref.models import ModelSpec, ProfileError, RopeScaling, model_from_dict

ARCHS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
         "Qwen3_5ForCausalLM": "qwen3_5", "Gemma3ForCausalLM": "gemma3"}
MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama", "qwen3_5": "qwen3_5_text",
               "gemma3": "gemma3_text"}
HYBRIDS = ("qwen3_5", "gemma3")  # their own fields: hf_hybrid.py
DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "llama3")
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings")
# config key -> ModelSpec field; each must be present (transformers' own defaults differ
# between versions and architectures, so a missing one is ambiguous)
REQUIRED = {"num_hidden_layers": "layers", "hidden_size": "hidden",
            "num_attention_heads": "heads", "intermediate_size": "intermediate",
            "vocab_size": "vocab", "rms_norm_eps": "rms_eps",
            "tie_word_embeddings": "tie_embeddings"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; one line naming what is wrong."""


def spec_from_config(config: dict, name: str, where: str) -> ModelSpec:
    """The ModelSpec a Hugging Face config.json describes, or CheckpointError naming the field."""
    arch = _arch(config, where)
    fields = {spec_key: _required(config, key, where) for key, spec_key in REQUIRED.items()}
    fields["rms_eps"] = _positive(fields["rms_eps"], "rms_norm_eps", where)
    fields.update(name=name, arch=arch, kv_heads=_kv_heads(config, arch, where),
                  head_dim=_head_dim(config, arch, where), dtype=_dtype(config, where),
                  max_context=_context(config, where))
    scaling = None
    if arch in HYBRIDS:
        fields.update(hybrid_fields(config, arch, where, CheckpointError))
    else:
        _refuse_unsupported(config, where)
        fields["rope_theta"], scaling = _rope(config, where)
    try:
        spec = model_from_dict(fields, default_name=name, where=where)
    except (ProfileError, TypeError, ValueError) as e:
        raise CheckpointError(str(e)) from None
    return attrs.evolve(spec, rope_scaling=scaling)


def _required(config: dict, key: str, where: str):
    if config.get(key) is None:
        raise CheckpointError(f"{where}: missing field {key!r}")
    return config[key]


def _context(config: dict, where: str) -> int | None:
    """max_position_embeddings, the longest prompt + output; absent: no limit is known."""
    value = config.get("max_position_embeddings")
    if value is not None and (type(value) is not int or value < 1):
        raise CheckpointError(f"{where}: field 'max_position_embeddings' must be an integer "
                              f">= 1, got {value!r}")
    return value


def _arch(config: dict, where: str) -> str:
    archs = config.get("architectures") or []
    known = sorted({ARCHS[a] for a in archs if a in ARCHS})
    by_type = {t: a for a, t in MODEL_TYPES.items()}
    if not archs and config.get("model_type") in by_type:
        known = [by_type[config["model_type"]]]
    if len(known) != 1 or any(a not in ARCHS for a in archs):
        raise CheckpointError(f"{where}: field 'architectures' {archs!r}: unknown architecture "
                              f"(supported: {', '.join(ARCHS)})")
    model_type = config.get("model_type", MODEL_TYPES[known[0]])
    if model_type != MODEL_TYPES[known[0]]:
        raise CheckpointError(f"{where}: field 'model_type' {model_type!r} contradicts "
                          f"'architectures' {archs!r}")
    return known[0]


def _refuse_unsupported(config: dict, where: str) -> None:
    """Biases, a non-SiLU MLP, sliding-window layers: math this engine does not do."""
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if config.get(key):
            raise CheckpointError(f"{where}: field {key!r} is true; not supported")
    act = _required(config, "hidden_act", where)
    if act != "silu":
        raise CheckpointError(f"{where}: field 'hidden_act' must be 'silu', got {act!r}")
    kinds = sorted(set(config.get("layer_types") or ()) - {"full_attention"})
    if kinds:
        raise CheckpointError(f"{where}: field 'layer_types' has {kinds[0]!r} layers; only "
                          "full_attention is supported")


def _kv_heads(config: dict, arch: str, where: str) -> int:
    """Qwen3Config's default (32) is not num_attention_heads (nor are the hybrids'), so only
    Llama may leave it out."""
    if config.get("num_key_value_heads") is not None or arch != "llama":
        return _required(config, "num_key_value_heads", where)
    return config["num_attention_heads"]  # LlamaConfig's own rule: no GQA


def _head_dim(config: dict, arch: str, where: str) -> int:
    """Qwen3Config's default (128) is not hidden/heads, so only Llama may leave it out."""
    head_dim = config.get("head_dim")
    if head_dim is not None:
        return head_dim
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if arch == "llama" and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 \
            and hidden % heads == 0:
        return hidden // heads  # LlamaConfig's own rule for an absent head_dim
    raise CheckpointError(f"{where}: missing field 'head_dim'")


def _dtype(config: dict, where: str) -> str:
    given = {k: config[k] for k in ("dtype", "torch_dtype") if config.get(k) is not None}
    if not given:
        raise CheckpointError(f"{where}: missing field 'dtype' (or 'torch_dtype')")
    if len(set(given.values())) > 1:
        raise CheckpointError(f"{where}: fields 'dtype' {given['dtype']!r} and 'torch_dtype' "
                          f"{given['torch_dtype']!r} contradict each other")
    dtype = next(iter(given.values()))
    if dtype not in DTYPES:
        key = next(iter(given))
        raise CheckpointError(f"{where}: field {key!r} {dtype!r} is not supported "
                          f"({', '.join(DTYPES)})")
    return dtype


def _rope(config: dict, where: str) -> tuple[float, RopeScaling | None]:
    """(theta, llama3 scaling or None) from `rope_parameters` and/or the top-level fields."""
    params = _rope_params(config, where)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"{where}: field 'partial_rotary_factor' {partial!r} is not "
                              "supported (only 1.0)")
    if params.get("rope_theta") is None:
        raise CheckpointError(f"{where}: missing field 'rope_theta' "
                              "(top level or in 'rope_parameters')")
    theta = _positive(params["rope_theta"], "rope_theta", where)
    if "rope_type" not in params and set(params) - {"rope_theta", "partial_rotary_factor"}:
        raise CheckpointError(f"{where}: missing field 'rope_type' beside rope settings "
                              f"{sorted(params)}")
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"{where}: field 'rope_type' {kind!r} is not supported "
                          f"({', '.join(ROPE_TYPES)})")
    return theta, _llama3(params, where) if kind == "llama3" else None


def _positive(value, key: str, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{where}: field {key!r} must be a number > 0, got {value!r}")
    return float(value)


def _rope_params(config: dict, where: str) -> dict:
    """One dict of rope settings merged from both layouts; a contradiction is refused."""
    merged: dict = {}
    origin: dict[str, str] = {}
    legacy = dict(config.get("rope_scaling") or {})
    if "type" in legacy:  # transformers < 4.45 spelled rope_type "type"
        legacy.setdefault("rope_type", legacy.pop("type"))
    sources = [("rope_parameters", config.get("rope_parameters") or {}),
               ("rope_scaling", legacy),
               ("the top level", {"rope_theta": config.get("rope_theta")})]
    for source, values in sources:
        if not isinstance(values, dict):
            raise CheckpointError(f"{where}: field {source!r} must be an object")
        for key, value in values.items():
            if value is None:
                continue
            if key in merged and merged[key] != value:
                raise CheckpointError(f"{where}: field {key!r} is {value!r} in {source} but "
                                      f"{merged[key]!r} in {origin[key]}")
            merged[key], origin[key] = value, source
    return merged


def _llama3(params: dict, where: str) -> RopeScaling:
    missing = [k for k in LLAMA3_FIELDS if params.get(k) is None]
    if missing:
        raise CheckpointError(f"{where}: llama3 rope scaling misses field {missing[0]!r}")
    return RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                       float(params["high_freq_factor"]),
                       int(params["original_max_position_embeddings"]))


def hf_config(spec: ModelSpec) -> dict:
    """The Hugging Face config.json of a dense spec (transformers 4 layout)."""
    if spec.arch in HYBRIDS:
        raise CheckpointError(f"model {spec.name!r}: writing a {spec.arch} config.json is not "
                              "supported (save the checkpoint with transformers)")
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
    if spec.max_context is not None:
        config["max_position_embeddings"] = spec.max_context
    s = spec.rope_scaling
    if s is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position}
    return config
