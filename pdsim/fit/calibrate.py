"""`pdsim calibrate TRACE... -o PROFILE.toml`: fit the cost model from traces' stage events.

Compute terms (per chunk, per token, per attention pair, contention) come from every trace's
`compute` stages; gather and link bandwidths (each link direction on its own) from the copy
stages; the per-span fixed cost and link latency from what is left of each span's
issue-to-land time, read the way the copier runs spans (pdsim/core/copier.py): serial, from
where the previous span ended; pipelined, from where each stage's lane was free. The copier is
what the traces show (a span issued before the previous one landed starts before that land
only on a pipelined copier), else `--copier`, else pipelined (pdgpu's copier). Copies of
traces whose link was paced (header `link_gbps`) are left out of the copy fits when unpaced
ones exist; export-only traces' `fill` stages give the payload write per byte. Serving
traces (`pdgpu serve`) add their `decode` stages: a decode step's fixed, per-row and per-KV-
token seconds (decode_s, decode_row_s, decode_kv_token_s), by the same
non-negative least squares; the profile's [compute] table carries them, and the decoder
loop's own time between two steps (decode_gap_s, plus land_byte_s per span byte it landed
and admit_byte_s per context byte it admitted there: pdsim/fit/serve_samples.py), and the
effective host cores prefill and decode shared (`host_cores`, when some ran together and a
count explains their times better than dedicated devices: pdsim/fit/sharing.py); the compute,
head and decode terms are then each one's time alone.
The profile written is an hw profile (with its link inline) that `pdsim run --hw
PROFILE.toml` accepts with the traces' model; each figure is printed with its residual.
Here: reading the traces' samples, the fit, and the command; the record is calibration.py's,
the profile's text calibration_toml.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from pdref.trace import read_trace
from pdsim.core.profile_fields import COPIERS
from pdsim.core.profiles import load_hw
from pdsim.fit.calibration import Calibration, figures
from pdsim.fit.calibration_toml import COPIER_BASIS, UNFITTED_LATENCY, profile_toml
from pdsim.fit.fitting import (
    alone,
    copier_of,
    fit_attention,
    fit_decode,
    fit_decode_gap,
    fit_fixed,
    fit_fixed_pipelined,
    fit_host_cores,
    fit_stage,
    is_streamed,
    link_stage_names,
    median,
)
from pdsim.fit.samples import TraceSamples, samples
from pdsim.fit.serve_samples import gap_samples
from pdsim.options import UsageError
from pdsim.views.report import write_atomic

__all__ = ["Calibration", "add_args", "calibrate", "command", "figures", "profile_toml",
           "read_samples"]


@attrs.frozen
class ReadSamples:
    """Every trace's samples together, and the model the traces name."""

    samples: TraceSamples
    model: str | None
    gaps: list  # GapSample: the decoder loop between decode steps (serving traces)


def read_samples(paths: list[str], skip_warmup: bool = True,
                 free: list[float] | None = None) -> ReadSamples:
    """`free`: per trace, the share of the host's cores other work left its run (measured;
    None: all of them)."""
    merged, models, gaps = TraceSamples([], [], [], [], [], []), set(), []
    for index, path in enumerate(paths):
        items = [item for _, item in read_trace(path)]
        header, events = items[0], items[1:]
        models.add(header.get("model"))
        got = samples(header, events, skip_warmup)
        share = 1.0 if free is None else free[index]
        merged.computes.extend(attrs.evolve(c, free=share) for c in got.computes)
        merged.copies.extend(attrs.evolve(c, trace=index) for c in got.copies)
        merged.heads.extend(attrs.evolve(h, free=share) for h in got.heads)
        merged.fills.extend(got.fills)
        merged.decodes.extend(attrs.evolve(d, free=share) for d in got.decodes)
        merged.latencies.extend(got.latencies)
        gaps += gap_samples(header, events)
    if len(models) > 1:
        raise UsageError(f"TRACE: traces name different models: {sorted(map(str, models))}")
    return ReadSamples(merged, models.pop(), gaps)


def calibrate(paths: list[str], skip_warmup: bool = True, copier: str | None = None,
              host_cores: int | None = None, free: list[float] | None = None) -> Calibration:
    """Fit every term; with `skip_warmup`, a trace's first request (of several) is left out.
    `copier` ("serial" or "pipelined") overrides what the traces show. `host_cores`: the
    traces' engine ran on one host of that many cores (CPU devices): the fitted effective
    count is at most that, never dedicated devices. `free`: per trace, the share of the
    host's cores other work left its run (measured); the count fitted is then the engine's
    with the host to itself, each trace's activities sharing that count times its share."""
    read = read_samples(paths, skip_warmup, free)
    computes, copies, got = read.samples.computes, read.samples.copies, read.samples
    if not computes and not copies and not got.decodes:
        raise UsageError("TRACE: no compute, copy or decode stage events to fit")
    shown = copier_of(copies)  # paced traces too: their spans queue most
    copies = [c for c in copies if not c.paced] or copies  # paced links hide the raw one
    names = link_stage_names(copies)
    links = tuple((n, fit_stage(copies, n)) for n in names)
    streamed = is_streamed(copies, names)
    kind, basis = ((copier, "given") if copier else (shown, "traces") if shown
                   else ("pipelined", "assumed"))
    gather = fit_stage(copies, "gather")
    fit_copier = fit_fixed if kind == "serial" else fit_fixed_pipelined
    fixed = fit_copier(copies, gather, links, streamed)
    sharing = fit_host_cores(computes, got.decodes, host_cores)  # before the terms it divides
    cores, slowdown = sharing.cores, sharing.slowdown
    compute, dense = fit_attention(computes, cores, slowdown)
    latencies = got.latencies
    latency = max(0.0, median(latencies))
    return Calibration(read.model, compute, gather, links, streamed, kind, basis,
                       fixed.latency_s, fixed.span_s, fixed.rms,
                       median(alone(got.heads, cores, slowdown)),
                       dense, fill_per_byte(got.fills), tuple(paths),
                       fit_decode(got.decodes, cores, slowdown), latency,
                       fit_decode_gap(read.gaps), cores, slowdown, len(latencies))


def fill_per_byte(fills: list[tuple[float, int]]) -> float:
    """Median seconds per byte of the export payload writes (0 when there are none)."""
    return median([s / n for s, n in fills if n > 0])



def add_args(p) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="engine traces with stage events (pdgpu run --trace)")
    p.add_argument("-o", "--output", required=True, help="profile TOML to write")
    p.add_argument("--hw", default="a100-pcie",
                   help="base profile for the figures traces cannot give (peak flops, HBM)")
    p.add_argument("--name", default=None, help="profile name (default: the output's stem)")
    p.add_argument("--keep-warmup", action="store_true",
                   help="fit a trace's first request too (default: left out when there are more)")
    p.add_argument("--copier", choices=COPIERS, default=None,
                   help="the engine's copier, instead of what the traces show (needed when "
                        "no span was issued while another was in flight, e.g. whole-copy "
                        "traces only; then pipelined is assumed)")
    p.add_argument("--host-cores", type=int, default=None, metavar="N",
                   help="the traces' engine ran on one host of N cores (CPU devices): fit an "
                        "effective shared core count of at most N (default: fit one only "
                        "when it explains the stages better than dedicated devices)")
    p.add_argument("--json", action="store_true", help="print the fitted figures as JSON")


def command(args) -> int:
    from pdref.violations import Violation

    if args.host_cores is not None and args.host_cores < 1:
        raise UsageError(f"--host-cores must be >= 1, got {args.host_cores}")
    base = load_hw(args.hw)
    try:
        cal = calibrate(args.traces, skip_warmup=not args.keep_warmup, copier=args.copier,
                        host_cores=args.host_cores)
    except Violation as v:
        raise UsageError(f"TRACE: not a legal trace: {v.code} {v.message}") from None
    name = args.name or Path(args.output).stem
    write_atomic(args.output, profile_toml(cal, base, name))
    rows = figures(cal)
    if args.json:
        print(json.dumps({"model": cal.model, "pipelined": cal.pipelined,
                          "copier": cal.copier, "copier_basis": cal.copier_basis,
                          "dense_attention": cal.dense_attention,
                          "serve_latency_samples": cal.serve_latency_samples, "figures": {
            n: {"value": v, "unit": u, "rms_residual_s": r} for n, v, u, r in rows}}))
    else:
        for n, v, u, r in rows:
            print(f"{n:18} {v:12.5g} {u:8} rms residual {r:.3e} s")
        print(f"{'dense_attention':18} {str(cal.dense_attention).lower():>12} (the better fit)")
        print(f"{'copier':18} {cal.copier:>12} ({COPIER_BASIS[cal.copier_basis]})")
        if cal.serve_latency_unfitted:
            print(f"{'serve_latency_s':18} {UNFITTED_LATENCY}")
        print(f"wrote {args.output} (use: pdsim run --hw {args.output} --model {cal.model})")
    return 0
