"""The field rules that hardware profiles (profiles.py) and engine profiles (engines.py)
share, and a calibrated profile's explicit compute terms (`ComputeOverride`), which either may
carry. Each rule raises ValueError naming the field; the loaders turn that into ProfileError
naming the file.
"""

from __future__ import annotations

import attrs

from pdref.models import ProfileError


def positive(_inst, attribute, value) -> None:
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
    positive(_inst, attribute, value)
    if value > 1:
        raise ValueError(f"field {attribute.name!r} must be in (0, 1], got {value!r}")


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
