"""The hybrid families' own config.json fields (Qwen3.5 text, Gemma 3 text), read strictly.

A hybrid's spec is a ModelSpec whose `extra` carries what the dense families do not have,
as plain values (the keys pdgpu.arch reads back):
  layer_kinds      one of "full", "sliding", "linear" per layer (HF `layer_types`)
  kv_layers        layers that keep K/V (full and sliding); the handoff's geometry
  rotary_dim       RoPE'd leading part of each head (Qwen3.5: partial_rotary_factor)
  qwen3_5:  linear_key_heads, linear_value_heads, linear_key_dim, linear_value_dim,
            conv_kernel (the gated DeltaNet layers)
  gemma3:   sliding_window, local_rope_theta, global_rope_factor, query_pre_attn_scalar,
            final_softcap (0.0: none)
Every field that changes the math must be present (transformers' defaults for these differ
between model sizes); a missing or unsupported one raises CheckpointError naming it.
"""

from __future__ import annotations

LAYER_KINDS = {"qwen3_5": {"linear_attention": "linear", "full_attention": "full"},
               "gemma3": {"sliding_attention": "sliding", "full_attention": "full"}}
ACTIVATIONS = {"qwen3_5": ("hidden_act", "silu"), "gemma3": ("hidden_activation",
                                                            "gelu_pytorch_tanh")}
LINEAR_FIELDS = {"linear_num_key_heads": "linear_key_heads",
                 "linear_num_value_heads": "linear_value_heads",
                 "linear_key_head_dim": "linear_key_dim",
                 "linear_value_head_dim": "linear_value_dim",
                 "linear_conv_kernel_dim": "conv_kernel"}
# rope_parameters keys that change nothing for text: Qwen3.5's multimodal RoPE sections all
# carry the same (text) position, which makes it plain RoPE
TEXT_NEUTRAL_ROPE = ("mrope_section", "mrope_interleaved")


def hybrid_fields(config: dict, arch: str, where: str, error) -> dict:
    """The ModelSpec fields (rope_theta, recurrent, the extras above) of a hybrid config."""
    _refuse(config, arch, where, error)
    kinds = _layer_kinds(config, arch, where, error)
    fields = {"layer_kinds": kinds, "kv_layers": sum(k != "linear" for k in kinds),
              "recurrent": "linear" in kinds}
    family = _qwen3_5 if arch == "qwen3_5" else _gemma3
    fields.update(family(config, where, error))
    return fields


def _refuse(config: dict, arch: str, where: str, error) -> None:
    if config.get("attention_bias"):
        raise error(f"{where}: field 'attention_bias' is true; not supported")
    key, want = ACTIVATIONS[arch]
    if config.get(key) != want:
        raise error(f"{where}: field {key!r} must be {want!r}, got {config.get(key)!r}")


def _layer_kinds(config: dict, arch: str, where: str, error) -> tuple[str, ...]:
    types, layers = config.get("layer_types"), config.get("num_hidden_layers")
    if not isinstance(types, list) or not types:
        raise error(f"{where}: missing field 'layer_types' (a list, one kind per layer)")
    known = LAYER_KINDS[arch]
    bad = [t for t in types if t not in known]
    if bad:
        raise error(f"{where}: field 'layer_types' has {bad[0]!r} layers ({arch} has "
                    f"{', '.join(known)})")
    if len(types) != layers:
        raise error(f"{where}: field 'layer_types' has {len(types)} entries, "
                    f"'num_hidden_layers' is {layers!r}")
    if "full_attention" not in types and arch == "qwen3_5":
        raise error(f"{where}: field 'layer_types' has no full_attention layer")
    return tuple(known[t] for t in types)


def _number(value, key: str, where: str, error, kind=float) -> float | int:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    if not ok or (kind is int and type(value) is not int):
        raise error(f"{where}: field {key!r} must be a{'n integer' if kind is int else ' number'}"
                    f" > 0, got {value!r}")
    return kind(value)


def _field(config: dict, key: str, where: str, error, kind=int):
    if config.get(key) is None:
        raise error(f"{where}: missing field {key!r}")
    return _number(config[key], key, where, error, kind)


def _default_rope(params, key: str, where: str, error, allowed=()) -> dict:
    """A rope_parameters object of type default (the only one these families use unscaled)."""
    if not isinstance(params, dict):
        raise error(f"{where}: missing field {key!r} (an object)")
    kind = params.get("rope_type")
    if kind is None:
        raise error(f"{where}: missing field 'rope_type' in {key!r}")
    extra = sorted(set(params) - {"rope_type", "rope_theta", *allowed})
    if kind not in ("default", "linear") or (kind == "default" and extra):
        what = f"field 'rope_type' {kind!r}" if kind not in ("default", "linear") else \
            f"field {extra[0]!r}"
        raise error(f"{where}: {what} in {key!r} is not supported")
    if params.get("rope_theta") is None:
        raise error(f"{where}: missing field 'rope_theta' in {key!r}")
    return params


def _qwen3_5(config: dict, where: str, error) -> dict:
    params = _default_rope(config.get("rope_parameters"), "rope_parameters", where, error,
                           ("partial_rotary_factor", *TEXT_NEUTRAL_ROPE))
    if params["rope_type"] != "default":
        raise error(f"{where}: field 'rope_type' {params['rope_type']!r} in 'rope_parameters' "
                    "is not supported (default)")
    if params.get("partial_rotary_factor") is None:
        raise error(f"{where}: missing field 'partial_rotary_factor' in 'rope_parameters'")
    factor = _number(params["partial_rotary_factor"], "partial_rotary_factor", where, error)
    head_dim = _field(config, "head_dim", where, error)
    rotary = int(head_dim * factor)
    if factor > 1 or rotary % 2:
        raise error(f"{where}: field 'partial_rotary_factor' {factor} gives {rotary} rotary "
                    f"dims of head_dim {head_dim} (must be even and <= head_dim)")
    fields = {new: _field(config, key, where, error) for key, new in LINEAR_FIELDS.items()}
    if fields["linear_value_heads"] % fields["linear_key_heads"]:
        raise error(f"{where}: field 'linear_num_value_heads' must be a multiple of "
                    "'linear_num_key_heads'")
    theta = _number(params["rope_theta"], "rope_theta", where, error)
    return {**fields, "rope_theta": theta, "rotary_dim": rotary}


def _gemma3(config: dict, where: str, error) -> dict:
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if config.get(key):
            raise error(f"{where}: field {key!r} is {config[key]!r}; not supported")
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        raise error(f"{where}: missing field 'rope_parameters' (transformers 5 layout: one "
                    "object per layer type)")
    local = _default_rope(rope.get("sliding_attention"), "rope_parameters.sliding_attention",
                          where, error)
    full = _default_rope(rope.get("full_attention"), "rope_parameters.full_attention", where,
                         error, ("factor",))
    if local["rope_type"] != "default":
        raise error(f"{where}: field 'rope_type' {local['rope_type']!r} in "
                    "'rope_parameters.sliding_attention' is not supported (default)")
    factor = 1.0
    if full["rope_type"] == "linear":
        factor = _field(full, "factor", where + " rope_parameters.full_attention", error, float)
    softcap = config.get("final_logit_softcapping")
    return {"rope_theta": _number(full["rope_theta"], "rope_theta", where, error),
            "local_rope_theta": _number(local["rope_theta"], "rope_theta", where, error),
            "global_rope_factor": factor,
            "sliding_window": _field(config, "sliding_window", where, error),
            "query_pre_attn_scalar": _field(config, "query_pre_attn_scalar", where, error,
                                            float),
            "final_softcap": 0.0 if softcap is None else
            _number(softcap, "final_logit_softcapping", where, error)}
