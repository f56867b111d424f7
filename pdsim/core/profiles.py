"""Hardware and link profiles: TOML files in specs/hw (devices) and specs/hw/links (copy paths).

A hardware profile holds datasheet facts; what software reaches on it is an engine profile
(pdsim/core/engines.py, specs/engines).

`--hw NAME` finds specs/hw/NAME.toml, `--link NAME` specs/hw/links/NAME.toml; either may be a
path to a user's own file. Every figure is validated at load; a bad one raises ProfileError
naming the file and the field.
"""

from __future__ import annotations

import attrs

from pdref.models import SPECS_DIR, ProfileError, read_toml, resolve_profile

HW_DIR = SPECS_DIR / "hw"
LINKS_DIR = HW_DIR / "links"


def _positive(_inst, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"field {attribute.name!r} must be a number > 0, got {value!r}")


def _at_least_one_core(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not 1 <= value < float("inf")):
        raise ValueError(f"field 'host_cores' must be a number >= 1 (cores), got {value!r}")


def non_negative(_inst, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"field {attribute.name!r} must be a number >= 0, got {value!r}")


COPIERS = ("serial", "pipelined")


def copier_rule(_inst, attribute, value) -> None:
    if value not in COPIERS:
        raise ValueError(f"field {attribute.name!r} must be one of {', '.join(map(repr, COPIERS))}"
                         f", got {value!r}")


def fraction(_inst, attribute, value) -> None:
    _positive(_inst, attribute, value)
    if value > 1:
        raise ValueError(f"field {attribute.name!r} must be in (0, 1], got {value!r}")


@attrs.frozen
class Stage:
    """One leg of a copy path (e.g. d2h, h2d, net) with its bandwidth in bytes per second."""

    name: str = attrs.field(validator=attrs.validators.min_len(1))
    bandwidth: float = attrs.field(validator=_positive)


@attrs.frozen
class LinkProfile:
    """The path a span's bytes take after the gather: its stages and fixed latency."""

    name: str
    stages: tuple[Stage, ...] = attrs.field(validator=attrs.validators.min_len(1))
    latency_s: float = attrs.field(default=0.0, validator=non_negative)
    pipelined: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    source: str = ""


@attrs.frozen
class ComputeOverride:
    """Explicit compute terms (a calibrated profile); None means derive from flops."""

    token_s: float | None = None
    pair_s: float | None = None
    chunk_s: float | None = None
    head_s: float | None = None  # the first token's LM head, once per request
    # Serving: the messages' round trip a request's first token waits (the prefill order
    # out, the token back), on no core and holding no producer. Absent: 0.
    serve_latency_s: float | None = None
    dense_attention: bool | None = None  # a chunk's attention is a dense masked rectangle
    # One batched decode step over `batch` requests reading `kv_tokens` KV tokens takes
    # decode_s + batch * decode_row_s + kv_tokens * decode_kv_token_s (pdgpu serve's decode
    # stages carry both). Absent: derived from the model and device (costs.py), not measured.
    decode_s: float | None = None
    decode_row_s: float | None = None
    decode_kv_token_s: float | None = None
    # The decoder's loop between steps (pdgpu serve: the gap between two decode stages): its
    # own time per step, per byte of a span it lands, per KV byte of a context it admits.
    # Absent: 0 (not modeled).
    decode_gap_s: float | None = None
    land_byte_s: float | None = None
    admit_byte_s: float | None = None
    # Cores the producers' prefill and the decoder's steps share (one host, CPU devices):
    # more of them running at once than this, each runs at host_cores / running speed
    # (pdsim/core/cores.py). A finite number >= 1 (calibrate fits an effective, maybe
    # fractional, count). Absent: every device has its own compute (GPUs), nothing is shared.
    host_cores: float | None = None
    # With host_cores: seconds of work per byte landed that each prefill chunk or head
    # running then loses (the landing's CPU work beside it, cores.py). Absent: 0.
    land_contention: float | None = None


@attrs.frozen
class HwProfile:
    """One device's datasheet facts: peak compute, HBM bandwidth and size, its link.

    `engine`: a calibrated profile (what `pdsim calibrate` writes) fits the device and the
    engine that ran on it together; its software fields form this engine (linear cost
    model), used when no `--engine` is given. Shipped profiles hold the datasheet alone."""

    name: str
    link: str | LinkProfile = attrs.field(
        validator=attrs.validators.instance_of((str, LinkProfile)))
    peak_flops: float = attrs.field(validator=_positive)  # dense tensor-core, the model's dtype
    hbm_bandwidth: float = attrs.field(validator=_positive)
    hbm_bytes: float | None = None
    arch: str = ""  # chip architecture (ampere, hopper): which kernels an engine runs on it
    source: str = ""
    model: str = ""  # the model a calibrated [compute] table was fitted for
    engine: object = None  # EngineProfile | None (pdsim/core/engines.py; see above)


def load_hw(name_or_path: str) -> HwProfile:
    """Load and validate a hardware profile; raises ProfileError naming the bad field."""
    path = resolve_profile(name_or_path, HW_DIR, "hw")
    return hw_from_dict(read_toml(path), default_name=path.stem, where=str(path))


def link_of(hw: HwProfile, override: str | None = None) -> LinkProfile:
    """The link a run uses: `override` if given, else the hw profile's (inline or by name)."""
    if override is None and isinstance(hw.link, LinkProfile):
        return hw.link
    return load_link(override or hw.link)


def load_link(name_or_path: str) -> LinkProfile:
    """Load and validate a link profile; raises ProfileError naming the bad field."""
    path = resolve_profile(name_or_path, LINKS_DIR, "link")
    return link_from_dict(read_toml(path), default_name=path.stem, where=str(path))


# Software fields a calibrated hw profile may carry (its embedded engine; engines.py)
ENGINE_KEYS = ("efficiency", "chunk_s", "gather_bandwidth", "span_s", "contention", "copier",
               "fill_byte_s", "compute")


def hw_from_dict(data: dict, default_name: str, where: str) -> HwProfile:
    from pdsim.core.engines import engine_from_dict  # engines.py builds on this module

    known = {f.name for f in attrs.fields(HwProfile)} - {"engine"}
    refuse_unknown(data, known | set(ENGINE_KEYS), where)
    fields = {k: v for k, v in data.items() if k in known}
    fields.setdefault("name", default_name)
    if isinstance(fields.get("link"), dict):
        fields["link"] = link_from_dict(fields["link"], f"{fields['name']}-link", f"{where} [link]")
    software = {k: v for k, v in data.items() if k in ENGINE_KEYS}
    engine = engine_from_dict({"cost_model": "linear", "name": fields["name"],
                               "source": "calibrated with the device", **software},
                              fields["name"], where) if software else None
    try:
        return HwProfile(**fields, engine=engine)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {short_error(e)}") from None


def check_compute(compute: ComputeOverride) -> ComputeOverride:
    """Each [compute] value's rule; raises ValueError naming the field."""
    for key, value in attrs.asdict(compute).items():
        if key == "host_cores":
            _at_least_one_core(value)
        elif key == "dense_attention":
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"field 'dense_attention' must be true or false, got "
                                 f"{value!r}")
        elif value is not None:
            non_negative(None, attrs.fields_dict(ComputeOverride)[key], value)
    if compute.land_contention and compute.host_cores is None:
        raise ValueError("field 'land_contention' needs 'host_cores' (a landing slows "
                         "prefill on shared host cores only)")
    return compute


def link_from_dict(data: dict, default_name: str, where: str) -> LinkProfile:
    refuse_unknown(data, {f.name for f in attrs.fields(LinkProfile)}, where)
    fields = dict(data)
    fields.setdefault("name", default_name)
    try:
        fields["stages"] = tuple(Stage(**s) for s in data.get("stages", ()))
        return LinkProfile(**fields)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {short_error(e)}") from None


def refuse_unknown(data: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        names = ", ".join(sorted(known))
        raise ProfileError(f"{where}: unknown field {unknown[0]!r} (known: {names})")


def short_error(error: Exception) -> str:
    text = str(error)
    if "missing" in text and "required" in text:
        return "missing required field: " + text.split("argument")[-1].strip(" :s")
    return text.split("\n")[0]
