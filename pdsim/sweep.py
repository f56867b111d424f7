"""`pdsim sweep`: a grid over chunk sizes, prompts, modes, max_pending and bandwidths.

Runs on a process pool (both cores by default) or, with `--ray [ADDRESS]`, on a Ray cluster
(pdsim/ray_sweep.py), with a progress bar; prints a table naming the best chunk size per
prompt, and writes CSV / JSON / a PNG atomically on request.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import itertools
import multiprocessing
import sys

import attrs
from tqdm import tqdm

from pdref.events import Mode
from pdref.models import context_error, load_model
from pdsim import sweep_load
from pdsim.core.config import SimConfig
from pdsim.options import UsageError, add_model_options, base_config
from pdsim.sweep_load import Load
from pdsim.sweep_point import COLUMNS, Point, evaluate
from pdsim.views.report import edge_note, labels_title, write_atomic, write_json


@attrs.frozen
class RayTarget:
    """Where `--ray` sends the sweep: a cluster's address, or None for a private local one."""

    address: str | None


def _ray_target(text: str) -> RayTarget:
    host, _, port = text.strip().rpartition(":")
    if text.strip() != "auto" and ("://" in host or not (host and port.isdigit()
                                                          and 0 < int(port) < 65536)):
        raise argparse.ArgumentTypeError(f"ADDRESS must be HOST:PORT of a Ray head (pdsim runs "
                                         f"on a node of the cluster) or auto, got {text!r}")
    return RayTarget(text.strip())


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {text!r}")
    return values


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or not min(values) > 0:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers > 0, got {text!r}")
    return values


def _modes(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in values if v not in {m.value for m in Mode}]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"must be a list of whole,chunk,layer, got {text!r}")
    return values


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument("--chunks", type=_ints, default=(64, 128, 256, 512, 1024, 2048),
                   help="prefill chunk sizes, tokens, comma separated")
    p.add_argument("--prompts", type=_ints, default=(8192,),
                   help="prompt lengths, tokens, comma separated")
    p.add_argument("--modes", type=_modes, default=("whole", "chunk", "layer"),
                   help="handoff modes, comma separated")
    p.add_argument("--max-pending", type=_ints, default=(2,),
                   help="copy spans in flight per producer, comma separated")
    p.add_argument("--bandwidths", type=_floats, default=(1.0,),
                   help="bandwidth scale factors (what-if)")
    p.add_argument("--prefix", type=int, default=0,
                   help="tokens the decoder already holds (every point)")
    p.add_argument("--no-compute", action="store_true",
                   help="export-only what-if: the copy path alone")
    p.add_argument("--requests", type=int, default=None,
                   help="each point a serving workload of this many requests of its prompt "
                        "(with --rate; run streamed: any count, memory of what is in flight)")
    p.add_argument("--rate", type=float, default=None,
                   help="with --requests: Poisson arrivals, requests/s")
    p.add_argument("--output-tokens", type=int, default=0,
                   help="with --requests: tokens each request generates")
    p.add_argument("--seed", type=int, default=0, help="with --requests: arrivals' seed")
    p.add_argument("--jobs", type=int, default=2,
                   help="worker processes, or the CPUs of the local Ray cluster (--ray with "
                        "an ADDRESS uses the cluster's own CPUs)")
    p.add_argument("--ray", nargs="?", const=RayTarget(None), default=None, type=_ray_target,
                   metavar="ADDRESS", help="run on a Ray cluster: HOST:PORT of its head or "
                   "auto; no ADDRESS: a local cluster for this command only")
    p.add_argument("--ray-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a Ray cluster at ADDRESS has to answer before it is refused")
    p.add_argument("--csv", default=None, help="write rows as CSV to this file")
    p.add_argument("--json", default=None, help="write rows as JSON to this file")
    p.add_argument("--png", default=None, help="plot completion and tail vs chunk size")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")


def grid(args) -> list[Point]:
    return [Point(*values) for values in itertools.product(
        args.modes, args.prompts, args.chunks, args.max_pending, args.bandwidths)]


def run_sweep(base: SimConfig, points: list[Point], prefix: int = 0, jobs: int = 2,
              progress: bool = True, load: Load | None = None) -> list[dict]:
    """Every point's metrics, in grid order, on `jobs` processes."""
    bar = dict(total=len(points), disable=not progress, unit="cfg", file=sys.stderr)
    one = functools.partial(evaluate, base, prefix=prefix, load=load)
    if jobs <= 1 or len(points) < 8:
        return [one(p) for p in tqdm(points, **bar)]
    chunksize = max(1, len(points) // (jobs * 16))
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return list(tqdm(pool.imap(one, points, chunksize), **bar))


def best_chunks(rows: list[dict]) -> dict[int, dict]:
    """Per prompt, the row with the smallest handoff (ties: smaller staging, then chunk)."""
    best: dict[int, dict] = {}
    for row in rows:
        key = (row["handoff_s"], row["peak_staging_bytes"], row["chunk"])
        current = best.get(row["prompt"])
        if current is None or key < (current["handoff_s"], current["peak_staging_bytes"],
                                     current["chunk"]):
            best[row["prompt"]] = row
    return best


def format_table(rows: list[dict]) -> str:
    head = f"{'mode':6} {'prompt':>7} {'chunk':>6} {'pend':>4} {'bw':>5} " \
           f"{'handoff ms':>11} {'tail ms':>9} {'staging MiB':>11}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['mode']:6} {r['prompt']:7d} {r['chunk']:6d} {r['max_pending']:4d} "
                     f"{r['bandwidth_scale']:5.3g} {r['handoff_s'] * 1e3:11.3f} "
                     f"{r['tail_s'] * 1e3:9.3f} {r['peak_staging_bytes'] / 2**20:11.2f}")
    for prompt, r in best_chunks(rows).items():
        edge = edge_note(r["chunk"], {x["chunk"] for x in rows})
        lines.append(f"best for prompt {prompt}: mode {r['mode']} chunk {r['chunk']} "
                     f"max_pending {r['max_pending']}: handoff {r['handoff_s'] * 1e3:.3f} ms"
                     + edge)
    return "\n".join(lines)


def to_csv(rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def command(args) -> int:
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.prefix < 0 or args.prefix % args.page_tokens:
        raise UsageError(f"--prefix must be a multiple of --page-tokens={args.page_tokens} "
                         f"and >= 0, got {args.prefix}")
    if args.prefix > min(args.prompts):
        raise UsageError(f"--prefix {args.prefix} must be <= every --prompts value "
                         f"(smallest {min(args.prompts)})")
    load = _load(args)
    problem = None if args.no_compute else context_error(
        load_model(args.model), max(args.prompts), load.output_tokens if load else 0,
        "--prompts")
    if problem:  # export only (--no-compute) has no positions: no limit
        raise UsageError(problem)
    base = base_config(args)
    base = attrs.evolve(base, no_compute=args.no_compute)
    if "layer" in args.modes and base.geometry.recurrent and base.geometry.kinds is None:
        raise UsageError("--modes: layer is refused for a recurrent model (CFG-1)")
    if args.ray is None:
        rows = run_sweep(base, grid(args), args.prefix, args.jobs, progress=not args.quiet,
                         load=load)
    else:
        rows = _run_on_ray(base, grid(args), args, load)
    _write_outputs(args, rows, base, load)
    if not args.quiet:
        print(labels_title(dict(base.labels)))  # what was swept: model, hw, engine, link
        print(format_table(rows) if load is None else sweep_load.format_table(rows))
    return 0


def _load(args) -> Load | None:
    """The workload of every point (--requests with --rate), or None: one request each."""
    if args.requests is None and args.rate is None:
        if args.output_tokens:
            raise UsageError("--output-tokens needs --requests and --rate (a workload point)")
        return None
    if args.requests is None or args.rate is None:
        raise UsageError("--requests and --rate go together: each point a workload of "
                         "--requests arrivals at --rate")
    for flag, ok in (("--requests", args.requests >= 1), ("--rate", args.rate > 0),
                     ("--output-tokens", args.output_tokens >= 0)):
        if not ok:
            raise UsageError(f"{flag} must be {'>= 0' if flag == '--output-tokens' else '> 0'}"
                             f", got {getattr(args, flag[2:].replace('-', '_'))}")
    if args.png:
        raise UsageError("--png plots one-request points; give it without --requests")
    return Load(args.requests, args.rate, args.output_tokens, args.seed)


def _run_on_ray(base: SimConfig, points: list[Point], args, load: Load | None) -> list[dict]:
    if not args.ray_timeout > 0:
        raise UsageError(f"--ray-timeout must be > 0 seconds, got {args.ray_timeout}")
    try:
        from pdsim.ray_sweep import run_on_ray
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        raise UsageError("--ray needs the ray package: pip install 'pdhandoff[ray]'") from None
    return run_on_ray(base, points, args.prefix, args.ray.address, args.jobs, args.ray_timeout,
                      progress=not args.quiet, load=load)


def _write_outputs(args, rows: list[dict], base: SimConfig, load: Load | None = None) -> None:
    best = best_chunks(rows) if load is None else sweep_load.best_points(rows)
    if args.csv:
        write_atomic(args.csv, to_csv(rows, COLUMNS if load is None else sweep_load.COLUMNS))
    if args.json:
        write_json(args.json, {"labels": dict(base.labels), "rows": rows,
                               "best": {str(k): v for k, v in best.items()}})
    if args.png:
        from pdsim.views.plots import plotted_rows, sweep_png

        best = best_chunks(plotted_rows(rows))
        write_atomic(args.png, sweep_png(rows, best, title=labels_title(dict(base.labels))))
