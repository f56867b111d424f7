"""Hardware and link profiles: TOML files in specs/hw (devices) and specs/hw/links (copy paths).

A hardware profile holds datasheet facts; what software reaches on it is an engine profile
(pdsim/core/engines.py, specs/engines). The rules their fields share: profile_fields.py.

`--hw NAME` finds specs/hw/NAME.toml, `--link NAME` specs/hw/links/NAME.toml; either may be a
path to a user's own file. Every figure is validated at load; a bad one raises ProfileError
naming the file and the field.
"""

from __future__ import annotations

import attrs

from pdref.models import SPECS_DIR, ProfileError, read_toml, resolve_profile
from pdsim.core.engines import engine_from_dict
from pdsim.core.profile_fields import non_negative, positive, refuse_unknown, short_error

HW_DIR = SPECS_DIR / "hw"
LINKS_DIR = HW_DIR / "links"


@attrs.frozen
class Stage:
    """One leg of a copy path (e.g. d2h, h2d, net) with its bandwidth in bytes per second."""

    name: str = attrs.field(validator=attrs.validators.min_len(1))
    bandwidth: float = attrs.field(validator=positive)


@attrs.frozen
class LinkProfile:
    """The path a span's bytes take after the gather: its stages and fixed latency."""

    name: str
    stages: tuple[Stage, ...] = attrs.field(validator=attrs.validators.min_len(1))
    latency_s: float = attrs.field(default=0.0, validator=non_negative)
    pipelined: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    source: str = ""


@attrs.frozen
class HwProfile:
    """One device's datasheet facts: peak compute, HBM bandwidth and size, its link.

    `engine`: a calibrated profile (what `pdsim calibrate` writes) fits the device and the
    engine that ran on it together; its software fields form this engine (linear cost
    model), used when no `--engine` is given. Shipped profiles hold the datasheet alone."""

    name: str
    link: str | LinkProfile = attrs.field(
        validator=attrs.validators.instance_of((str, LinkProfile)))
    peak_flops: float = attrs.field(validator=positive)  # dense tensor-core, the model's dtype
    hbm_bandwidth: float = attrs.field(validator=positive)
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


def link_from_dict(data: dict, default_name: str, where: str) -> LinkProfile:
    refuse_unknown(data, {f.name for f in attrs.fields(LinkProfile)}, where)
    fields = dict(data)
    fields.setdefault("name", default_name)
    try:
        fields["stages"] = tuple(Stage(**s) for s in data.get("stages", ()))
        return LinkProfile(**fields)
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {short_error(e)}") from None
