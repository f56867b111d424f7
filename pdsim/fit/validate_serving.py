"""`pdsim validate --serving`: run `pdgpu serve` over a grid of serving configurations on
this machine, calibrate the simulator on the training part, predict the held-out rest.

Each point serves prompts drawn here (pdsim/fit/serve_runs.py) in a closed loop. The
training points' traces feed `pdsim calibrate` (prefill compute per chunk from compute
stages, gather and link from copy stages, the decode step from decode stages, and the
effective host cores prefill and decode shared, each as if alone); the serving
simulator (pdsim.core.serving) then plays every point's very prompts with that profile,
each link direction paced as the engine paced it. The errors of tokens/s and of the median
TTFT on the held-out points are the result; the training points' errors are calibration,
reported apart, and so are `in_sample` errors: each held-out run predicted from a profile
calibrated on its own trace. Those say what the model misses when the machine runs as it
did in that very run; the held-out errors add what the machine's own drift between runs
does (on a shared machine, the larger part: the same point and prompts served four times
in a row on a quiet machine gave 26..45 tokens/s, README).

Host load, a measured input: while each run serves, pdsim/fit/host_load.py measures the
share of the host's cores other processes and the hypervisor (steal) took. Calibration
takes each training trace's share out (the engine's cores and a slowdown per share, fitted
on the training traces only) and the prediction of every run puts that run's own measured
share back in. Nothing of a run's outcome goes into its share. The headline figures use
it; `without_host_load` gives the same figures with neither fit nor prediction using it.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import attrs
from tqdm import tqdm

from pdref.models import load_model
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import Costs, costs_for, engine_of, sim_geometry
from pdsim.core.profiles import link_of, load_hw
from pdsim.core.serving import serving_config, simulate_serving
from pdsim.fit.calibrate import calibrate, profile_toml
from pdsim.fit.predict import paced
from pdsim.fit.serve_runs import SERVE_GRIDS, ServePoint, ServeRun, run_serve
from pdsim.fit.sharing import load_factor, run_cores
from pdsim.options import UsageError
from pdsim.views.report import write_atomic

SCORED = ("tokens_per_s", "ttft_p50_s")  # what the targets are about


@attrs.frozen
class ServeRow:
    """One serving configuration: what the engine measured and what the simulator predicted."""

    run: ServeRun
    role: str
    predicted: dict

    def err_pct(self, key: str) -> float:
        """|predicted / measured - 1| of one summary figure, in percent."""
        return 100.0 * abs(self.predicted[key] / self.run.summary[key] - 1.0)

    def to_json(self) -> dict:
        point = attrs.asdict(self.run.point)
        figures = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "handoff_p50_s",
                   "wall_s")
        return {**point, "name": self.run.point.name, "role": self.role, "trace": self.run.trace,
                **{f"measured_{k}": self.run.summary.get(k) for k in figures},
                **{f"predicted_{k}": self.predicted.get(k) for k in figures},
                "tps_err_pct": self.err_pct("tokens_per_s"),
                "ttft_p50_err_pct": self.err_pct("ttft_p50_s"),
                "host_load": self.run.host_load.to_json() if self.run.host_load else None}


def run_serve_grid(grid, model: str, out: Path, device: str | None = None,
                   progress: bool = True) -> list[tuple[ServeRun, str]]:
    """Every point on the engine (files under out/serve/POINT/)."""
    vocab = load_model(model).vocab
    done = []
    bar = tqdm(grid, desc="serve runs", unit="run", disable=not progress, file=sys.stderr)
    for point, role in bar:
        bar.set_postfix_str(point.name)
        folder = out / "serve" / (point.name + ("-repeat" if role == "repeat" else ""))
        done.append((run_serve(point, model, vocab, folder, device), role))
    return done


@attrs.frozen
class Fitted:
    """A calibrated profile and how other work on the host slowed its traces' runs."""

    path: Path
    load_slowdown: float = 0.0  # calibrate's load_slowdown (0: host load not an input)
    host_load: bool = False  # predictions take each run's measured host load as an input


def free_share(run: ServeRun, host_load: bool) -> float:
    """The share of the host's cores other work left the run (1: not an input, or not
    measured)."""
    if not host_load or run.host_load is None:
        return 1.0
    load = run.host_load
    return 1.0 - load.taken_cores / load.cores


def fit_serving_profile(runs: list[tuple[ServeRun, str]], out: Path, model: str,
                        name: str = "serving-profile.toml", host_cores: int | None = None,
                        host_load: bool = False) -> Fitted:
    """Calibrate from the training runs' traces; the profile is out/NAME. `host_cores`: the
    engine's processes shared this host's that many cores (CPU devices). `host_load`: each
    trace's measured host load is an input of the fit (sharing.Sharing)."""
    train = [run for run, role in runs if role == "train"]
    if not train:
        raise UsageError("serving grid: no training point to calibrate from")
    path = out / name
    cal = calibrate([run.trace for run in train], host_cores=host_cores,
                    free=[free_share(run, host_load) for run in train])
    write_atomic(path, profile_toml(cal, load_hw("a100-pcie"), f"{model}-serve"))
    return Fitted(path, cal.load_slowdown, host_load)


def in_sample_rows(runs: list[tuple[ServeRun, str]], model: str, predictor,
                   host_cores: int | None = None, host_load: bool = False) -> list[ServeRow]:
    """Each held-out run predicted from a profile calibrated on its own trace alone."""
    spec, rows = load_model(model), []
    suffix = "-load" if host_load else ""
    for run, role in runs:
        if role == "test":
            own = fit_serving_profile([(run, "train")], Path(run.trace).parent, model,
                                      f"own-profile{suffix}.toml", host_cores, host_load)
            rows.append(ServeRow(run, role, predictor(spec, own, run)))
    return rows


def serving_requests(prompts: list[dict]) -> list[RequestSpec]:
    """A run's prompts as the simulator's requests (closed loop: arrivals are the loop's)."""
    return [RequestSpec(row["req"], 0.0, len(row["tokens"]), 0, row["output_tokens"])
            for row in prompts]


def serving_setup(spec, profile: str, point: ServePoint, prompts: list[dict],
                  stages: bool = False) -> tuple[SimConfig, list[RequestSpec]]:
    """The simulator's config and requests for a point served with `prompts`: the profile's
    costs, each link direction paced as the engine paced it, the engine's defaults."""
    hw = load_hw(profile)
    engine = engine_of(hw)
    costs = paced(costs_for(spec, hw, link_of(hw), engine), point.link_gbps)
    pacing = (("link_gbps", point.link_gbps),) if point.link_gbps else ()
    cfg = SimConfig(sim_geometry(spec), costs, point.mode, point.chunk,
                    producers=point.producers, output_tokens=point.output_tokens,
                    stages=stages, labels=(("model", spec.name), ("hw", hw.name),
                                                 ("engine", engine.name), *pacing))
    requests = serving_requests(prompts)
    return serving_config(cfg, requests, concurrency=point.concurrency), requests


LOADED_TERMS = ("chunk_s", "token_s", "pair_s", "head_s", "decode_s", "decode_row_s",
                "decode_kv_token_s", "land_contention")  # fitted with its load_slowdown


def under_load(costs: Costs, free: float, slowdown: float) -> Costs:
    """`costs` on a host of which other work left `free`: the engine's activities share that
    share of its cores (dedicated devices: none shared), each slowed by
    sharing.load_factor, as calibrate took it out of every sample (fitting.alone)."""
    if free == 1.0:
        return costs
    factor = load_factor(slowdown, free)
    return attrs.evolve(costs, host_cores=run_cores(costs.host_cores, free),
                        **{term: getattr(costs, term) * factor for term in LOADED_TERMS})


def predict_serving(spec, profile: Fitted | str, run: ServeRun) -> dict:
    """The serving simulator's summary of the run's point, prompts and pacing (and, with a
    `Fitted` profile that takes it, the host load measured during the run)."""
    fitted = profile if isinstance(profile, Fitted) else Fitted(Path(profile))
    cfg, requests = serving_setup(spec, str(fitted.path), run.point, run.prompts)
    costs = under_load(cfg.costs, free_share(run, fitted.host_load), fitted.load_slowdown)
    return simulate_serving(attrs.evolve(cfg, costs=costs), requests)


def serving_summary(rows: list[ServeRow], role: str = "test") -> dict:
    """Median / worst errors of tokens/s and TTFT p50 over the rows of one role."""
    chosen = [r for r in rows if r.role == role]
    if not chosen:
        return {"n": 0}
    tps = [r.err_pct("tokens_per_s") for r in chosen]
    ttft = [r.err_pct("ttft_p50_s") for r in chosen]
    return {"n": len(chosen), "median_tps_err_pct": statistics.median(tps),
            "worst_tps_err_pct": max(tps), "median_ttft_p50_err_pct": statistics.median(ttft),
            "worst_ttft_p50_err_pct": max(ttft)}


def repeat_summary(runs: list[tuple[ServeRun, str]]) -> dict:
    """Each `repeat` run against the first run of its point: |repeat / first - 1| of
    tokens/s and TTFT p50, in percent (identical work, the host's drift between them)."""
    first = {}
    for run, role in runs:
        if role != "repeat":
            first.setdefault(run.point, run)
    pairs = [_repeat_pair(first[run.point], run) for run, role in runs
             if role == "repeat" and run.point in first]
    if not pairs:
        return {"n": 0}
    return {"n": len(pairs), "pairs": pairs,
            "worst_tps_diff_pct": max(p["tps_diff_pct"] for p in pairs),
            "worst_ttft_p50_diff_pct": max(p["ttft_p50_diff_pct"] for p in pairs)}


def _repeat_pair(first: ServeRun, repeat: ServeRun) -> dict:
    diff = {key: 100.0 * abs(repeat.summary[key] / first.summary[key] - 1.0) for key in SCORED}
    return {"name": first.point.name,
            **{key: [first.summary[key], repeat.summary[key]] for key in SCORED},
            "tps_diff_pct": diff["tokens_per_s"], "ttft_p50_diff_pct": diff["ttft_p50_s"]}


def engine_host_cores(device: str | None) -> int | None:
    """The cores `pdgpu serve`'s processes share on this host: all of them on CPU devices
    (its default), none to share on GPUs (each process its own device)."""
    return os.cpu_count() if (device or "cpu") == "cpu" else None


def predicted_rows(runs, model: str, out: Path, host: int | None, predictor,
                   host_load: bool) -> tuple[Fitted, list[ServeRow]]:
    """Calibrate on the training runs, predict every run (host load an input or not)."""
    name = "serving-profile.toml" if host_load else "serving-profile-no-load.toml"
    fitted = fit_serving_profile(runs, out, model, name, host, host_load)
    spec = load_model(model)
    return fitted, [ServeRow(run, role, predictor(spec, fitted, run)) for run, role in runs]


def validate_serving(model: str, grid_name: str, out: Path, device: str | None = None,
                     progress: bool = True, predictor=predict_serving
                     ) -> tuple[list[ServeRow], dict]:
    """Serve the grid, calibrate on its training runs, predict every run; rows and JSON.
    The headline figures take each run's measured host load as an input (host_load.py);
    `without_host_load` gives the same figures without it."""
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]  # other work on the host: the held-out errors' floor
    runs = run_serve_grid(SERVE_GRIDS[grid_name], model, out, device, progress)
    load_after = os.getloadavg()[0]
    host = engine_host_cores(device)
    fitted, rows = predicted_rows(runs, model, out, host, predictor, host_load=True)
    _, plain = predicted_rows(runs, model, out, host, predictor, host_load=False)
    result = {"model": model, "grid": grid_name, "profile": str(fitted.path),
              **serving_summary(rows, "test"),
              "host_load_input": all(run.host_load is not None for run, _ in runs),
              "load_slowdown": fitted.load_slowdown,
              "load_average": [load_before, load_after],  # 1-minute, before and after
              "repeats": repeat_summary(runs),
              "train": serving_summary(rows, "train"),
              "in_sample": serving_summary(in_sample_rows(runs, model, predictor, host, True)),
              "without_host_load": {
                  **serving_summary(plain, "test"), "train": serving_summary(plain, "train"),
                  "in_sample": serving_summary(in_sample_rows(runs, model, predictor, host))},
              "configs": [r.to_json() for r in rows if r.role == "test"],
              "train_configs": [r.to_json() for r in rows if r.role == "train"],
              "configs_without_host_load": [r.to_json() for r in plain if r.role == "test"]}
    return rows, result


def format_table(rows: list[ServeRow]) -> str:
    lines = [f"{'role':5} {'point':44} {'tok/s':>7} {'pred':>7} {'err%':>6} "
             f"{'TTFT50 ms':>9} {'pred':>8} {'err%':>6}"]
    for r in rows:
        m, p = r.run.summary, r.predicted
        lines.append(f"{r.role:5} {r.run.point.name:44} {m['tokens_per_s']:7.1f} "
                     f"{p['tokens_per_s']:7.1f} {r.err_pct('tokens_per_s'):6.1f} "
                     f"{m['ttft_p50_s'] * 1e3:9.1f} {p['ttft_p50_s'] * 1e3:8.1f} "
                     f"{r.err_pct('ttft_p50_s'):6.1f}")
    return "\n".join(lines)


def format_summary(result: dict) -> str:
    lines = []
    plain = result.get("without_host_load", {})
    for label, s in (("held-out", result), ("training (calibration)", result["train"]),
                     ("held-out, each calibrated on its own run", result["in_sample"]),
                     ("held-out without the host load input", plain),
                     ("training without it", plain.get("train", {})),
                     ("held-out on own runs without it", plain.get("in_sample", {}))):
        if s.get("n"):
            lines.append(f"{label} ({s['n']} configs): tokens/s error median "
                         f"{s['median_tps_err_pct']:.1f}%, worst {s['worst_tps_err_pct']:.1f}%;"
                         f" TTFT p50 error median {s['median_ttft_p50_err_pct']:.1f}%, worst "
                         f"{s['worst_ttft_p50_err_pct']:.1f}%")
    repeats = result.get("repeats", {})
    if repeats.get("n"):
        lines.append(f"the same point and prompts served again later ({repeats['n']} pairs): "
                     f"tokens/s moved up to {repeats['worst_tps_diff_pct']:.1f}%, TTFT p50 up "
                     f"to {repeats['worst_ttft_p50_diff_pct']:.1f}% (the host's own drift)")
    return "\n".join(lines)


def command(args) -> int:
    """`pdsim validate --serving`: the grid, the profile, the table or one JSON object."""
    import json

    from pdsim.views.validate_plot import serving_png

    load_model(args.model)
    out = Path(args.out)
    rows, result = validate_serving(args.model, args.grid, out, args.device,
                                    progress=not args.quiet)
    write_atomic(out / "serving-validation.png", serving_png(rows))
    write_atomic(out / "serving-validation.json", json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(rows))
        print(format_summary(result))
        print(f"wrote {out / 'serving-validation.json'}, {out / 'serving-validation.png'}, "
              f"{result['profile']}")
    return 0
