"""Engine profiles: what software achieves on a device, apart from the device's datasheet.

`--engine NAME` finds specs/engines/NAME.toml (or a path to a user's file). Two cost models:
  - "linear" (`seed-eager`, and every profile `pdsim calibrate` fits): prefill at
    peak_flops x `efficiency` plus `chunk_s` a chunk, decode terms derived or fitted
    (pdsim/core/costs.py), as the simulator priced every run before engines were split off;
  - "roofline" (`production`): each op the larger of its FLOPs at the engine's compute
    efficiency for the op's shape and its bytes at its memory efficiency, plus overheads
    (pdsim/core/roofline.py). Its efficiency tables are per chip architecture (a hardware
    profile's `arch`): the kernels differ (FlashAttention-2 on Ampere, -3 on Hopper).
Every figure is validated at load; a bad one raises ProfileError naming the file and field.
"""

from __future__ import annotations

import attrs

from pdref.models import SPECS_DIR, ProfileError, read_toml, resolve_profile
from pdsim.core.profile_fields import (
    ComputeOverride,
    check_compute,
    copier_rule,
    fraction,
    non_negative,
    refuse_unknown,
    short_error,
)

ENGINES_DIR = SPECS_DIR / "engines"
COST_MODELS = ("linear", "roofline")
DEFAULT_ENGINE = "production"


def _curve(_inst, attribute, value) -> None:
    """An efficiency table: [[x, efficiency], ...], x > 0 increasing, efficiency in (0, 1]."""
    xs = [x for x, _ in value]
    if not value or xs != sorted(set(xs)) or not all(x > 0 for x in xs):
        raise ValueError(f"field {attribute.name!r} must be [[x, efficiency], ...] with x > 0 "
                         f"increasing, got {value!r}")
    for _, e in value:
        fraction(None, attribute, e)


def _as_curve(value) -> tuple[tuple[float, float], ...]:
    try:
        return tuple((float(x), float(e)) for x, e in value)
    except (TypeError, ValueError):
        raise ValueError(f"an efficiency table must be [[x, efficiency], ...], got {value!r}")\
            from None


@attrs.frozen
class ArchFigures:
    """A roofline engine's kernel efficiencies on one chip architecture (fractions of peak)."""

    gemm: tuple[tuple[float, float], ...] = attrs.field(converter=_as_curve, validator=_curve)
    attention_prefill: tuple[tuple[float, float], ...] = attrs.field(converter=_as_curve,
                                                                     validator=_curve)
    memory: float = attrs.field(validator=fraction)  # weights streamed by a GEMM, of HBM
    kv_memory: float = attrs.field(validator=fraction)  # paged decode attention's KV read


@attrs.frozen
class EngineProfile:
    """One serving engine's achieved figures (software), priced on any hardware profile."""

    name: str
    cost_model: str = attrs.field(validator=attrs.validators.in_(COST_MODELS))
    chunk_s: float = attrs.field(validator=non_negative)  # fixed cost of a prefill forward
    span_s: float = attrs.field(validator=non_negative)  # a copy span's fixed cost
    contention: float = attrs.field(validator=non_negative)
    copier: str = attrs.field(default="serial", validator=copier_rule)
    # The gather's rate: a fraction of the device's HBM bandwidth, or (calibrated) bytes/s
    gather_efficiency: float | None = None
    gather_bandwidth: float | None = None
    fill_byte_s: float = attrs.field(default=0.0, validator=non_negative)
    efficiency: float | None = None  # linear: fraction of peak reached by every FLOP
    compute: ComputeOverride = ComputeOverride()  # linear: fitted terms
    # roofline: per-op figures
    decode_step_s: float = attrs.field(default=0.0, validator=non_negative)  # per decode step
    layer_s: float = attrs.field(default=0.0, validator=non_negative)  # per layer per forward
    gemm_dim_half: float = attrs.field(default=0.0, validator=non_negative)
    arch: tuple[tuple[str, ArchFigures], ...] = ()
    source: str = ""

    def figures_for(self, arch: str) -> ArchFigures:
        """The kernel figures of this engine on `arch`; refused when the file has none."""
        found = dict(self.arch).get(arch)
        if found is None:
            known = ", ".join(a for a, _ in self.arch)
            raise ProfileError(f"engine {self.name!r}: no figures for chip architecture "
                               f"{arch!r} (it has: {known})")
        return found

    def gather_rate(self, hbm_bandwidth: float) -> float:
        if self.gather_bandwidth is not None:
            return self.gather_bandwidth
        return hbm_bandwidth * self.gather_efficiency


def list_engines() -> list[str]:
    return sorted(p.stem for p in ENGINES_DIR.glob("*.toml"))


def load_engine(name_or_path: str) -> EngineProfile:
    """Load and validate an engine profile; raises ProfileError naming the bad field."""
    path = resolve_profile(name_or_path, ENGINES_DIR, "engine")
    return engine_from_dict(read_toml(path), default_name=path.stem, where=str(path))


_ARCH_KEYS = {f.name for f in attrs.fields(ArchFigures)}


def engine_from_dict(data: dict, default_name: str, where: str) -> EngineProfile:
    """An EngineProfile from a TOML table: top-level fields, [compute], one table per arch."""
    fields = {f.name for f in attrs.fields(EngineProfile)}
    archs = {k: v for k, v in data.items() if isinstance(v, dict) and k not in fields}
    refuse_unknown({k: v for k, v in data.items() if k not in archs}, fields, where)
    values = {k: v for k, v in data.items() if k in fields - {"compute", "arch"}}
    values.setdefault("name", default_name)
    try:
        for arch, table in archs.items():
            refuse_unknown(table, _ARCH_KEYS, f"{where} [{arch}]")
        values["arch"] = tuple((a, ArchFigures(**t)) for a, t in sorted(archs.items()))
        compute = check_compute(ComputeOverride(**data.get("compute", {})))
        engine = EngineProfile(**values, compute=compute)
        _check_complete(engine)
        return engine
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: {short_error(e)}") from None


def _check_complete(engine: EngineProfile) -> None:
    """The fields its cost model needs, and exactly one way to rate the gather."""
    if (engine.gather_efficiency is None) == (engine.gather_bandwidth is None):
        raise ValueError("give exactly one of fields 'gather_efficiency' (of HBM bandwidth) "
                         "and 'gather_bandwidth' (bytes/s)")
    if engine.gather_efficiency is not None:
        fraction(None, attrs.fields(EngineProfile).gather_efficiency, engine.gather_efficiency)
    if engine.gather_bandwidth is not None and not engine.gather_bandwidth > 0:
        raise ValueError(f"field 'gather_bandwidth' must be a number > 0, got "
                         f"{engine.gather_bandwidth!r}")
    if engine.cost_model == "linear":
        fraction(None, attrs.fields(EngineProfile).efficiency, engine.efficiency)
    elif not engine.arch:
        raise ValueError("a roofline engine needs at least one chip architecture table "
                         "(e.g. [ampere]) with gemm, attention_prefill, memory, kv_memory")
