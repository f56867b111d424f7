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
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from pdref.trace import read_trace
from pdsim.core.engines import load_engine
from pdsim.core.profile_fields import COPIERS
from pdsim.core.profiles import link_of, load_hw
from pdsim.fit.fitting import (
    Fit,
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

SEED_ENGINE = "seed-eager"  # a calibrated profile's unfitted efficiency (derived terms)


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


COPIER_BASIS = {
    "traces": "what the traces show (spans issued while another was in flight)",
    "given": "given (--copier)",
    "assumed": "assumed (no span was issued while another was in flight): pdgpu's copier",
}


def _bandwidth(per_byte: float) -> float:
    return 1.0 / per_byte if per_byte > 0 else 1e18


def profile_toml(cal: Calibration, base, name: str) -> str:
    """An hw profile (link inline) holding the fitted figures; base supplies the rest."""
    c = cal.compute
    lines = [
        f"# Calibrated by `pdsim calibrate` from {len(cal.traces)} trace(s): "
        + ", ".join(Path(p).name for p in cal.traces),
        f"# compute fit: {c.samples} samples, rank {c.rank}/4, rms residual {c.rms:.3e} s "
        f"({100 * c.rel_rms:.2f}%); copy fixed-cost rms residual {cal.copy_rms:.3e} s",
        f"# peak_flops, hbm_bandwidth, arch: from base profile {base.name!r}; efficiency: "
        f"{SEED_ENGINE}'s (neither fitted)",
        *([] if c.samples else [
            "# no compute stages in the traces (export only): compute terms are 0, so this "
            "profile predicts export-only runs (--no-compute) only"]),
        f"name = {json.dumps(name)}",
        f"source = {json.dumps('pdsim calibrate; base ' + base.name)}",
        f"model = {json.dumps(cal.model or '')}",
        f"peak_flops = {base.peak_flops!r}",
        f"hbm_bandwidth = {base.hbm_bandwidth!r}",
        f"arch = {json.dumps(base.arch)}",
        f"efficiency = {load_engine(SEED_ENGINE).efficiency!r}",
        f"chunk_s = {c.get('chunk_s')!r}",
        f"gather_bandwidth = {_bandwidth(cal.gather.get('per_byte_s'))!r}"
        f"  # rms {cal.gather.rms:.3e} s over {cal.gather.samples} spans",
        f"span_s = {cal.span_s!r}",
        f"contention = {c.get('contention')!r}",
        f"copier = {json.dumps(cal.copier)}  # {COPIER_BASIS[cal.copier_basis]}",
        f"fill_byte_s = {cal.fill_byte_s!r}  # export only: median of the `fill` stages",
        "", "[compute]",
        f"token_s = {c.get('token_s')!r}",
        f"pair_s = {c.get('pair_s')!r}",
        f"dense_attention = {'true' if cal.dense_attention else 'false'}"
        "  # the better fit: pairs of a chunk [a, b) are n * b (true) or the causal triangle",
        f"chunk_s = {c.get('chunk_s')!r}",
        f"head_s = {cal.head_s!r}  # median of the traces' `head` stages",
        *_serve_latency_lines(cal),
        *_decode_lines(cal.decode, cal.decode_gap),
        *([] if cal.host_cores is None else [
            f"host_cores = {cal.host_cores!r}  # effective cores the producers' compute and "
            "the decoder's steps shared (processor sharing; the terms above: each alone)",
            f"land_contention = {cal.land_contention!r}  # seconds per byte landed that "
            "the prefill running then lost (pdsim/core/cores.py)"]),
        *([] if not cal.load_slowdown else [
            f"# fitted with each trace's measured host load: the terms above are on an idle "
            f"host; other work holding a share x of its cores left the engine host_cores * "
            f"(1 - x) and slowed each term by 1 + {cal.load_slowdown:.3g} * x"]),
    ]
    return "\n".join(lines + (_link_lines(cal, name) if cal.links else _base_link(base))) + "\n"


def _link_lines(cal: Calibration, name: str) -> list[str]:
    lines = ["", "[link]", f"name = {json.dumps(name + '-link')}",
             f"pipelined = {'true' if cal.pipelined else 'false'}",
             f"latency_s = {cal.latency_s!r}"]
    for stage, f in cal.links:
        lines += ["", "[[link.stages]]", f"name = {json.dumps(stage)}",
                  f"bandwidth = {_bandwidth(f.get('per_byte_s'))!r}"
                  f"  # rms {f.rms:.3e} s over {f.samples} spans"]
    return lines


def _base_link(base) -> list[str]:
    """No copy stage in the traces (e.g. decode steps only): the base profile's link."""
    link = link_of(base)
    lines = ["", "[link]  # no copy stages in the traces: the base profile's link, not fitted",
             f"name = {json.dumps(link.name)}",
             f"pipelined = {'true' if link.pipelined else 'false'}",
             f"latency_s = {link.latency_s!r}"]
    for stage in link.stages:
        lines += ["", "[[link.stages]]", f"name = {json.dumps(stage.name)}",
                  f"bandwidth = {stage.bandwidth!r}"]
    return lines


def _serve_latency_lines(cal: Calibration) -> list[str]:
    if cal.serve_latency_unfitted:
        return [f"serve_latency_s = 0.0  # {UNFITTED_LATENCY}"]
    if not cal.serve_latency_samples:
        return []
    return [f"serve_latency_s = {cal.serve_latency_s!r}  # serving: the first token's message "
            f"round trip (a delay: no core, no producer held); median of "
            f"{cal.serve_latency_samples} requests"]


UNFITTED_LATENCY = ("NOT FITTED, 0: no request of these traces found its producer idle with "
                    "no decode step holding its first token (add such a trace, e.g. "
                    "concurrency 1)")


def _decode_lines(decode: Fit, gap: Fit) -> list[str]:
    """The [compute] decode-step fields, when the traces had decode stages (serving traces);
    without them the simulator derives the terms from the model and device."""
    if not decode.samples:
        return []
    return [f"# decode step = decode_s + decode_row_s * batch + decode_kv_token_s * kv_tokens:"
            f" {decode.samples} steps, rank {decode.rank}/3, rms residual {decode.rms:.3e} s "
            f"({100 * decode.rel_rms:.2f}%)",
            *(f"{n} = {decode.get(n)!r}" for n in decode.names),
            f"# decoder loop between steps = decode_gap_s + land_byte_s * bytes landed + "
            f"admit_byte_s * context bytes admitted: {gap.samples} gaps, rms residual "
            f"{gap.rms:.3e} s",
            *(f"{n} = {gap.get(n)!r}" for n in gap.names)]


def figures(cal: Calibration) -> list[tuple[str, float, str, float]]:
    """(name, value, unit, rms residual of its fit in seconds)."""
    c = cal.compute
    out = [(n, c.get(n), u, c.rms) for n, u in (("chunk_s", "s/chunk"), ("token_s", "s/token"),
                                                 ("pair_s", "s/pair"), ("contention", "x"))]
    out.append(("gather_bandwidth", _bandwidth(cal.gather.get("per_byte_s")), "B/s",
                cal.gather.rms))
    out += [(f"{n}_bandwidth", _bandwidth(f.get("per_byte_s")), "B/s", f.rms)
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
