"""What `pdsim calibrate` fitted: the Calibration record (every figure with the fit it came
from) and its figures as printed (name, value, unit, residual)."""

from __future__ import annotations

import attrs

from pdsim.fit.fitting import Fit


@attrs.frozen
class Calibration:
    """Every fitted figure of the cost model, with the fits they came from."""

    model: str | None
    compute: Fit
    gather: Fit
    links: tuple[tuple[str, Fit], ...]
    pipelined: bool  # the link's stages stream within a span (link profile `pipelined`)
    copier: str  # "serial" or "pipelined": how spans share the copier
    copier_basis: str  # "traces" (what they show), "given" (--copier) or "assumed"
    latency_s: float
    span_s: float
    copy_rms: float
    head_s: float
    dense_attention: bool
    fill_byte_s: float  # export only: payload write per byte (0 without fill stages)
    traces: tuple[str, ...]
    decode: Fit  # serving traces: one decode step (no samples: none in the traces)
    serve_latency_s: float  # serving traces: a request's message round trip (else 0)
    decode_gap: Fit  # serving traces: the decoder loop between steps (no samples: none)
    host_cores: float | None = None  # effective shared cores (None: dedicated devices)
    # per share of the host other work held (traces with a measured `free`): how much longer
    # the compute, head and decode terms took (sharing.load_factor); 0 without one
    load_slowdown: float = 0.0
    serve_latency_samples: int = 0  # the requests serve_latency_s is the median of

    @property
    def land_contention(self) -> float:
        """Seconds per byte landed that the prefill running then lost (0: not fitted)."""
        names = self.compute.names
        return self.compute.get("land_contention") if "land_contention" in names else 0.0

    @property
    def serve_latency_unfitted(self) -> bool:
        """Serving traces (decode steps), yet no request to read the round trip from: each
        found its producer busy or a decode step holding its first token."""
        return bool(self.decode.samples) and not self.serve_latency_samples



def bandwidth(per_byte: float) -> float:
    """Bytes per second of a fitted seconds-per-byte term (unbounded when it is 0)."""
    return 1.0 / per_byte if per_byte > 0 else 1e18


def figures(cal: Calibration) -> list[tuple[str, float, str, float]]:
    """(name, value, unit, rms residual of its fit in seconds)."""
    c = cal.compute
    out = [(n, c.get(n), u, c.rms) for n, u in (("chunk_s", "s/chunk"), ("token_s", "s/token"),
                                                 ("pair_s", "s/pair"), ("contention", "x"))]
    out.append(("gather_bandwidth", bandwidth(cal.gather.get("per_byte_s")), "B/s",
                cal.gather.rms))
    out += [(f"{n}_bandwidth", bandwidth(f.get("per_byte_s")), "B/s", f.rms)
            for n, f in cal.links]
    out += [("latency_s", cal.latency_s, "s", cal.copy_rms), ("span_s", cal.span_s, "s",
                                                               cal.copy_rms),
            ("head_s", cal.head_s, "s", 0.0), ("fill_byte_s", cal.fill_byte_s, "s/B", 0.0),
            ("serve_latency_s", cal.serve_latency_s, "s", 0.0)]
    if cal.host_cores is not None:
        out += [("host_cores", cal.host_cores, "cores", 0.0),
                ("land_contention", cal.land_contention, "s/B", cal.compute.rms)]
    if cal.decode.samples:
        units = {"decode_s": "s/step", "decode_row_s": "s/row", "decode_kv_token_s": "s/token"}
        out += [(n, cal.decode.get(n), units[n], cal.decode.rms) for n in cal.decode.names]
        units = {"decode_gap_s": "s/gap", "land_byte_s": "s/B", "admit_byte_s": "s/B"}
        out += [(n, cal.decode_gap.get(n), units[n], cal.decode_gap.rms)
                for n in cal.decode_gap.names]
    return out
