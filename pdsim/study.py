"""`pdsim study`: where does chunk/layer overlap pay in serving? The seed's open question.

For each model, device (`--hw`, a100-pcie and h200) and engine (`--engine`: the production-
class profile and the seed's eager calibration), the serving model (closed loop, the
decoder's continuous batch, pdgpu serve's queued sender and source cache) plays the same
workload in whole, chunk and layer mode, one axis varied at a time around a base point:
prompt length, concurrency, link bandwidth (a scale on every copy bandwidth), copy/compute
contention (the slowdown of a compute chunk per second of producer-side copy, gather and
d2h, it overlaps) and the producer's source cache (1 prompt: it starts the next prefill only
when the last request was admitted; 2: pdgpu serve's, the next prefill overlaps the last
copy); each axis at concurrency 1 and at the base's. The gain of a mode is its tokens/s over
whole copy's, in percent (and its TTFT p50 change). The base point itself, at concurrency 1
and the base's, is the report's headline: the answer under each engine side by side. Writes
`study.csv`, one PNG per model, device and engine, and `report.md`, whose words are drawn
from the rows.
"""

from __future__ import annotations

import argparse
import csv
import io
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import attrs

from pdref.models import context_error, list_models
from pdref.plan import plan_chunks
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import costs_for, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.profiles import link_of, load_hw
from pdsim.core.serving import serving_config, simulate_serving
from pdsim.core.twins import model_or_twin
from pdsim.views.report import write_atomic

MODES = ("whole", "chunk", "layer")
AXES = {
    "prompt": (1024, 2048, 4096, 8192, 16384),
    "concurrency": (1, 2, 4, 8, 16, 32),
    "bandwidth": (0.125, 0.25, 0.5, 1.0, 2.0, 4.0),
    "contention": (0.0, 0.05, 0.15, 0.3, 0.5),
    "source": (1, 2),
}
BASE = "base"  # the base point's own rows (the report's headline)
BRIEF = (-3.0, 17.0)  # the seed's measured spread of chunk overlap's serving change, %
# Copy work on the producer that slows the compute it overlaps: the gather and the d2h DMA
# (both read the producer's HBM), not the profile's gather alone.
CONTENDED = ("gather", "d2h")


@attrs.frozen
class Point:
    """One simulated configuration of the study."""

    hw: str
    engine: str
    model: str
    mode: str
    axis: str  # the axis varied ("base" for the base point itself)
    prompt: int
    concurrency: int
    bandwidth: float
    contention: float | None  # None: the hw profile's
    source: int  # prompts the producer's source cache holds (2: pdgpu serve's)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="qwen3-0.6b,qwen3-4b", help="model presets, comma "
                   f"separated ({', '.join(list_models())}) or profile .toml files")
    p.add_argument("--hw", default="a100-pcie,h200", help="hardware profiles, comma separated")
    p.add_argument("--engine", default="production,seed-eager",
                   help="engine profiles, comma separated (the answer under each)")
    p.add_argument("--requests", type=int, default=64, help="requests per configuration")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens each request makes")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk, tokens")
    p.add_argument("--prompt", type=int, default=4096, help="base point: prompt tokens")
    p.add_argument("--concurrency", type=int, default=8,
                   help="base point: closed loop C (every axis is also run at C = 1)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--out", default="study-out", help="folder for report.md, PNGs, CSV")


def points(args) -> list[Point]:
    """The base point and each axis's values around it, at concurrency 1 and at the base's
    (the concurrency axis once), for every device, engine, model and mode."""
    grid = []
    for concurrency in dict.fromkeys((1, args.concurrency)):
        base = dict(prompt=args.prompt, concurrency=concurrency, bandwidth=1.0,
                    contention=None, source=2)
        grid.append((BASE, base))
        grid += [(axis, {**base, axis: v}) for axis, values in AXES.items()
                 if axis != "concurrency" for v in values]
    base = dict(prompt=args.prompt, concurrency=args.concurrency, bandwidth=1.0,
                contention=None, source=2)
    grid += [("concurrency", {**base, "concurrency": v}) for v in AXES["concurrency"]]
    return [Point(hw, engine, model, mode, axis, **values) for hw in args.hw.split(",")
            for engine in args.engine.split(",") for model in args.models.split(",")
            for axis, values in grid for mode in MODES]


def point_config(point: Point, requests: int, output_tokens: int,
                 chunk: int) -> tuple[SimConfig, list[RequestSpec]]:
    """One point's serving configuration and its closed-loop workload."""
    spec, hw = model_or_twin(point.model), load_hw(point.hw)
    costs = attrs.evolve(costs_for(spec, hw, link_of(hw), load_engine(point.engine))
                         .scaled(bandwidth=point.bandwidth),
                         contended=CONTENDED)
    if point.contention is not None:
        costs = attrs.evolve(costs, contention=point.contention)
    work = [RequestSpec(f"r{i}", 0.0, point.prompt) for i in range(requests)]
    geometry = sim_geometry(spec)
    cfg = SimConfig(geometry, costs, point.mode, chunk, output_tokens=output_tokens,
                    stages=False)
    source = point.source * geometry.pages_for(point.prompt)
    return serving_config(cfg, work, concurrency=point.concurrency, source_pages=source), work


def point_row(point: Point, cfg: SimConfig, summary: dict) -> dict:
    """A point's row from its run's summary (`simulate_serving`'s keys)."""
    costs = cfg.costs
    prefill = sum(costs.compute_s(c) for c in plan_chunks(point.prompt, 0, cfg.chunk))
    return {**attrs.asdict(point), "contention_used": costs.contention, "prefill_s": prefill,
            **{k: summary[k] for k in ("tokens_per_s", "ttft_p50_s", "itl_p99_s",
                                       "handoff_p50_s", "tail_mean_s", "decode_batch_mean")}}


def run_point(point: Point, requests: int, output_tokens: int, chunk: int) -> dict:
    """Simulate one point; its row."""
    cfg, work = point_config(point, requests, output_tokens, chunk)
    return point_row(point, cfg, simulate_serving(cfg, work))


def answer_rows(models, hws, engines, prompt: int, concurrencies, requests: int,
                output_tokens: int, chunk: int) -> list[dict]:
    """The base point alone (whole, chunk and layer) for each device, engine, model and
    concurrency, with gains: the study's headline (`pdsim demo` shows it too)."""
    todo = [Point(hw, engine, model, mode, BASE, prompt, c, 1.0, None, 2) for hw in hws
            for engine in engines for model in models for c in concurrencies for mode in MODES]
    return with_gains([run_point(p, requests, output_tokens, chunk) for p in todo])


def with_gains(rows: list[dict]) -> list[dict]:
    """Each row with its tokens/s gain and TTFT p50 change over whole copy, in percent."""
    key = ("hw", "engine", "model", "axis", "prompt", "concurrency", "bandwidth", "contention",
           "source")
    whole = {tuple(r[k] for k in key): r for r in rows if r["mode"] == "whole"}
    for r in rows:
        w = whole[tuple(r[k] for k in key)]
        r["gain_pct"] = 100.0 * (r["tokens_per_s"] / w["tokens_per_s"] - 1.0)
        r["ttft_change_pct"] = 100.0 * (r["ttft_p50_s"] / w["ttft_p50_s"] - 1.0)
    return rows


def run_study(args) -> list[dict]:
    todo = points(args)
    extra = (args.requests, args.output_tokens, args.chunk)
    if args.jobs <= 1:
        return with_gains([run_point(p, *extra) for p in todo])
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_point, p, *extra) for p in todo]
        return with_gains([f.result() for f in futures])


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def command(args) -> int:
    from pdsim.views.study_report import (  # matplotlib
        axis_groups,
        png_name,
        report_text,
        study_png,
    )

    for name in ("requests", "output_tokens", "chunk", "prompt", "concurrency", "jobs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}")
    longest = max(args.prompt, *AXES["prompt"])
    for model in args.models.split(","):  # an unknown one is refused before anything is written
        problem = context_error(model_or_twin(model), longest, args.output_tokens,
                                "--prompt / the prompt axis")
        if problem:
            raise ValueError(problem)
    for hw in args.hw.split(","):  # an unknown one is refused before anything is written
        load_hw(hw)
    for engine in args.engine.split(","):
        load_engine(engine)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run_study(args)
    write_atomic(out / "study.csv", _csv(rows))
    for (hw, engine), group in axis_groups(rows).items():
        for model in args.models.split(","):
            (out / png_name(model, hw, engine)).write_bytes(
                study_png(group, model, f"{hw} under {engine}", BRIEF))
    write_atomic(out / "report.md", report_text(rows, args, AXES, BRIEF))
    print(f"pdsim study: {len(rows)} configurations -> {out / 'report.md'}")
    return 0
