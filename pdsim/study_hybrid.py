"""`pdsim study-hybrid`: how much smaller is the handoff of a hybrid model, and does chunk
or layer overlap still pay?

For each device (`--hw`), engine (`--engine`), model and prompt length, the serving model
(`pdsim study`'s: closed loop, the decoder's continuous batch, pdgpu serve's queued sender
and two-prompt source cache) plays the same workload in whole, chunk and layer mode at each
concurrency of `--concurrency`. The models: a dense reference (qwen3-0.6b), the hybrid
presets (Qwen3.5: linear-attention layers that hand off a fixed state; Gemma 3: sliding
layers that hand off their window) and each hybrid's all-full twin (NAME+full: the same
model with every layer full attention, `study.all_full`), which separates what the layer
kinds buy from what the model's size does. A row holds the bytes a request hands off, the
prefill, whole copy's tail and each mode's tokens/s gain and handoff change over whole.

Writes `hybrid.csv`, a PNG per engine, `report.md` (tables and findings read off the rows),
and the trace of each hybrid preset's run in each mode at the longest prompt on the first
device and engine (`traces/`), every one checked by `pdref check` (its verdict in the
report; a refused trace fails the command).
"""

from __future__ import annotations

import argparse
import functools
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import attrs

from pdref.check import check_file
from pdref.models import context_error
from pdsim.core.engines import load_engine
from pdsim.core.metrics import workload_metrics
from pdsim.core.play import simulate
from pdsim.core.profiles import load_hw
from pdsim.core.twins import ALL_FULL, model_or_twin
from pdsim.study import MODES, Point, point_config, point_row
from pdsim.views.report import write_atomic, write_trace

MODELS = ("qwen3-0.6b", "qwen3.5-27b", "gemma-3-27b")
PROMPTS = (2048, 4096, 8192, 16384, 32768)
AXIS = "hybrid"  # the rows' axis (study.Point)


@attrs.frozen
class HybridGrid:
    """What the study runs."""

    models: tuple[str, ...]  # dense and hybrid presets; each hybrid's twin is added
    hws: tuple[str, ...]
    engines: tuple[str, ...]
    prompts: tuple[int, ...]
    concurrencies: tuple[int, ...]
    requests: int
    output_tokens: int
    chunk: int

    def with_twins(self) -> tuple[str, ...]:
        """The models, each hybrid followed by its all-full twin."""
        out = []
        for name in self.models:
            out.append(name)
            if model_or_twin(name).layer_kinds() is not None:
                out.append(name + ALL_FULL)
        return tuple(out)

    def points(self) -> list[Point]:
        return [Point(hw, engine, model, mode, AXIS, prompt, c, 1.0, None, 2)
                for hw in self.hws for engine in self.engines for model in self.with_twins()
                for prompt in self.prompts for c in self.concurrencies for mode in MODES]

    def traced(self, point: Point) -> bool:
        """A hybrid preset's run at the longest prompt and lowest concurrency on the first
        device and engine: its trace is written and checked."""
        return (point.hw, point.engine, point.prompt, point.concurrency) == (
            self.hws[0], self.engines[0], max(self.prompts), min(self.concurrencies)) \
            and model_or_twin(point.model).layer_kinds() is not None


def trace_name(point: Point) -> str:
    return f"{point.model}-{point.mode}-{point.prompt}.jsonl"


def run_hybrid_point(point: Point, grid: HybridGrid, traces: Path | None) -> dict:
    """Simulate one point; its row (study's columns, the bytes a request hands off, and the
    trace file written, if any)."""
    cfg, work = point_config(point, grid.requests, grid.output_tokens, grid.chunk)
    result = simulate(cfg, work)
    summary = workload_metrics(result)
    row = point_row(point, cfg, summary)
    row.update(bytes_per_request=summary["bytes"] // summary["requests"], trace="")
    if traces is not None and grid.traced(point):
        write_trace(str(traces / trace_name(point)), result)
        row["trace"] = f"traces/{trace_name(point)}"
    return row


def with_changes(rows: list[dict]) -> list[dict]:
    """Each row with its tokens/s gain and handoff p50 change over whole copy (percent),
    and its bytes over its dense reference's and its twin's, per prompt token."""
    key = ("hw", "engine", "model", "prompt", "concurrency")
    whole = {tuple(r[k] for k in key): r for r in rows if r["mode"] == "whole"}
    for r in rows:
        w = whole[tuple(r[k] for k in key)]
        r["gain_pct"] = 100.0 * (r["tokens_per_s"] / w["tokens_per_s"] - 1.0)
        r["handoff_change_pct"] = 100.0 * (r["handoff_p50_s"] / w["handoff_p50_s"] - 1.0)
        r["tail_share_pct"] = 100.0 * w["tail_mean_s"] / w["prefill_s"]
        r["bytes_per_token"] = r["bytes_per_request"] / r["prompt"]
    twin = {(r["model"], r["prompt"]): r["bytes_per_request"] for r in rows}
    for r in rows:
        full = twin.get((r["model"] + ALL_FULL, r["prompt"]))
        r["twin_bytes_ratio"] = full / r["bytes_per_request"] if full else None
    return rows


def run_grid(grid: HybridGrid, jobs: int, traces: Path | None) -> list[dict]:
    one = functools.partial(run_hybrid_point, grid=grid, traces=traces)
    todo = grid.points()
    if jobs <= 1:
        return with_changes([one(p) for p in todo])
    with ProcessPoolExecutor(jobs) as pool:
        return with_changes(list(pool.map(one, todo, chunksize=4)))


def check_traces(rows: list[dict], out: Path) -> list:
    """`pdref check` of every trace the rows name."""
    return [check_file(out / r["trace"]) for r in rows if r["trace"]]


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(w) for w in _words(text))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {text!r}")
    return values


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=_words, default=MODELS,
                   help="model presets or profile files, comma separated (each hybrid's "
                        "all-full twin NAME+full is added)")
    p.add_argument("--hw", type=_words, default=("a100-pcie", "h200"),
                   help="hardware profiles, comma separated")
    p.add_argument("--engine", type=_words, default=("production",),
                   help="engine profiles, comma separated")
    p.add_argument("--prompts", type=_ints, default=PROMPTS,
                   help="prompt lengths, tokens, comma separated")
    p.add_argument("--concurrency", type=_ints, default=(1, 8),
                   help="closed-loop concurrencies, comma separated")
    p.add_argument("--requests", type=int, default=32, help="requests per configuration")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens each request makes")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk, tokens")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--out", default="study-hybrid-out", help="folder for report.md, PNGs, "
                   "CSV and traces")


def grid_of(args) -> HybridGrid:
    """The grid the options ask for; a bad value raises ValueError naming the option."""
    for name in ("requests", "output_tokens", "chunk", "jobs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}")
    for model in args.models:  # an unknown one is refused before anything is written
        problem = context_error(model_or_twin(model), max(args.prompts), args.output_tokens,
                                "--prompts")
        if problem:
            raise ValueError(problem)
    for hw in args.hw:
        load_hw(hw)
    for engine in args.engine:
        load_engine(engine)
    return HybridGrid(tuple(args.models), tuple(args.hw), tuple(args.engine),
                      tuple(sorted(set(args.prompts))), tuple(sorted(set(args.concurrency))),
                      args.requests, args.output_tokens, args.chunk)


def run_study(grid: HybridGrid, out: Path, jobs: int) -> list[dict]:
    """Every row; the traces written under `out/traces` (their `pdref check`:
    `check_traces`)."""
    (out / "traces").mkdir(parents=True, exist_ok=True)
    return run_grid(grid, jobs, out / "traces")


def write_outputs(rows: list[dict], grid: HybridGrid, out: Path) -> None:
    """hybrid.csv and a PNG per engine under `out` (the report: `report_text`)."""
    from pdsim.views.hybrid_report import hybrid_csv, hybrid_png, png_name  # matplotlib

    write_atomic(out / "hybrid.csv", hybrid_csv(rows))
    for engine in grid.engines:
        write_atomic(out / png_name(engine), hybrid_png(rows, engine))


def command(args) -> int:
    from pdsim.views.hybrid_report import report_text

    grid = grid_of(args)
    out = Path(args.out)
    rows = run_study(grid, out, args.jobs)
    checks = check_traces(rows, out)
    write_outputs(rows, grid, out)
    write_atomic(out / "report.md", report_text(rows, grid, checks))
    refused = [c for c in checks if not c.ok]
    print(f"pdsim study-hybrid: {len(rows)} configurations, {len(checks)} traces checked"
          f"{f', {len(refused)} REFUSED' if refused else ', all legal'} -> {out / 'report.md'}")
    return 1 if refused else 0
