"""A Calibration written as an hw profile (its link inline) that `pdsim run --hw` accepts:
each fitted figure with its residual, the base profile's for what traces cannot give."""

from __future__ import annotations

import json
from pathlib import Path

from pdsim.core.engines import load_engine
from pdsim.core.profiles import link_of
from pdsim.fit.calibration import Calibration, bandwidth
from pdsim.fit.fitting import Fit

SEED_ENGINE = "seed-eager"  # a calibrated profile's unfitted efficiency (derived terms)

COPIER_BASIS = {
    "traces": "what the traces show (spans issued while another was in flight)",
    "given": "given (--copier)",
    "assumed": "assumed (no span was issued while another was in flight): pdgpu's copier",
}


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
        f"gather_bandwidth = {bandwidth(cal.gather.get('per_byte_s'))!r}"
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
                  f"bandwidth = {bandwidth(f.get('per_byte_s'))!r}"
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
