"""pdsim against measured multi-turn runs (issue 35 item 4): calibrate pdsim on the traces of
some `bench/multiturn.py` runs, then predict every run's workload with that profile.

    python bench/multiturn.py --seed 0 --trace-dir A --json > A/report.json
    python bench/multiturn.py --seed 1 --trace-dir B --json > B/report.json
    python bench/multiturn_sim.py --train A --test B

A folder is one bench run: its report (`report.json`: the options and each cache setting's
figures) and each setting's trace (`<setting>.jsonl`). `pdsim calibrate` fits a profile on
every trace of the `--train` folders (`--host-cores`: this machine's cores); `pdsim run`
then plays each run's workload (the same `--sessions ... --seed`: pdsim's SessionSpec is
what the bench drew its lengths, think times and starts from) with that profile, the run's
pool and cache budgets (its trace header). Per run and figure: measured, predicted, error.
Rows of `--train` folders are calibration (the profile saw their traces), rows of `--test`
folders validation (held out). When the bench measured the host load of every run (the
cores other work took while its sessions ran, pdsim/fit/host_load.py), it is an input as in
`pdsim validate --serving`: the fit takes each training run's share out, each prediction
puts its run's own back in (rows `load in`); the rows without it follow.

Measured figures: the decoder's hit rate (prompt tokens its reserves found cached, `reserve`
`prefix`, over all prompt tokens: pdsim's `prefix_cache_hit_rate`), the producer's hit
tokens (`computed` `hit` pages), bytes handed off (`issue`), from the trace; TTFT p50/p99 and
output tokens/s as the bench's client measured them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: `bench` is found from the checkout

from bench.multiturn import trace_figures  # noqa: E402
from pdref.outfile import write_atomic  # noqa: E402
from pdsim.core.metrics import workload_metrics  # noqa: E402
from pdsim.core.play import simulate  # noqa: E402
from pdsim.core.profiles import load_hw  # noqa: E402
from pdsim.fit.calibrate import calibrate, profile_toml  # noqa: E402
from pdsim.fit.validate_serving import under_load  # noqa: E402
from pdsim.options import add_run_options, run_setup  # noqa: E402

FIGURES = ("prefix_cache_hit_rate", "computed_tokens", "bytes", "ttft_p50_s", "ttft_p99_s",
           "tokens_per_s")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=Path, nargs="+", required=True, help="calibrate on these")
    p.add_argument("--test", type=Path, nargs="*", default=[], help="held-out runs")
    p.add_argument("--host-cores", type=int, default=os.cpu_count())
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for folder in [*args.train, *args.test]:
        problem = _report_problem(folder)
        if problem:
            p.error(f"--train/--test: {folder}: {problem} (bench/multiturn.py --trace-dir "
                    "FOLDER --json > FOLDER/report.json)")
    return args


def _report_problem(folder: Path) -> str | None:
    """Why `folder` is not a bench run to read, or None."""
    path = folder / "report.json"
    if not path.is_file():
        return "holds no report.json"
    try:
        report = json.loads(path.read_text())
    except ValueError:
        return "report.json is not JSON (a run still writing it?)"
    if not isinstance(report, dict) or not {"options", "runs"} <= report.keys():
        return "report.json is not bench/multiturn.py's report"
    missing = [r["setting"] for r in report["runs"]
               if not (folder / f"{r['setting']}.jsonl").is_file()]
    return f"no trace of setting {missing[0]!r}" if missing else None


def measured(folder: Path) -> list[dict]:
    """Each cache setting of a bench run: its options, trace figures and client figures."""
    report = json.loads((folder / "report.json").read_text())
    rows = []
    for run in report["runs"]:
        trace = folder / f"{run['setting']}.jsonl"
        rows.append({"folder": str(folder), "setting": run["setting"], "trace": trace,
                     "options": report["options"], **trace_figures(trace),
                     "host_load": run.get("host_load"),
                     **{k: run[k] for k in ("ttft_p50_s", "ttft_p99_s", "tokens_per_s")}})
    return rows


def cache_flags(row: dict) -> tuple[str, ...]:
    """pdsim's caches with the budgets the engine's trace header gives (none: no cache)."""
    if not (row["producer_cache_pages"] or row["decoder_cache_pages"]):
        return ()
    return ("--producer-cache-pages", str(row["producer_cache_pages"]),
            "--decoder-cache-pages", str(row["decoder_cache_pages"]))


def free_share(row: dict) -> float:
    """The share of the host's cores other work left the run while its sessions ran
    (measured by the bench; 1: not measured)."""
    load = row["host_load"]
    return 1.0 if load is None else 1.0 - load["taken_cores"] / load["cores"]


def sim_args(row: dict, profile: Path) -> argparse.Namespace:
    """`pdsim run`'s options for the run's workload, pool and caches."""
    o = row["options"]
    a, b = o["turn_tokens"]
    p = argparse.ArgumentParser()
    add_run_options(p)
    return p.parse_args([
        "--model", o["model"], "--hw", str(profile), "--sessions", str(o["sessions"]),
        "--turns", str(o["turns"]), "--system-prompt", str(o["system_prompt"]),
        "--turn-tokens", f"{a}:{b}", "--output-tokens", str(o["output_tokens"]), "--think",
        str(o["think"]), "--rate", str(o["rate"]), "--seed", str(o["seed"]), "--chunk",
        str(o["chunk"]), "--producers", str(o["producers"]), "--pool-pages",
        str(row["pool_pages"]), "--sender", "queued", *cache_flags(row)])


def predict(row: dict, profile: Path, slowdown: float | None) -> dict:
    """pdsim's figures for the run (`slowdown`: calibrate's, with the run's measured host
    load an input, as `pdsim validate --serving` takes it; None: not an input)."""
    cfg, requests = run_setup(sim_args(row, profile))
    if slowdown is not None:
        cfg = attrs.evolve(cfg, costs=under_load(cfg.costs, free_share(row), slowdown))
    result = simulate(cfg, requests)
    sim = {"prefix_cache_hit_rate": 0.0,  # no cache: no hit
           **workload_metrics(result), "computed_tokens": computed_tokens(result)}
    return {k: sim.get(k) for k in FIGURES}


def computed_tokens(result) -> int:
    """Prompt tokens the simulated producers computed (`computed` events without a hit)."""
    layers = result.cfg.geometry.layers
    done = sum((e.tokens[1] - e.tokens[0]) * (e.layers[1] - e.layers[0])
               for e in result.protocol if e.kind == "computed" and not getattr(e, "hit", None))
    return round(done / layers)


def fit(train: list[dict], folder: Path, host_cores: int, host_load: bool) -> tuple:
    """The profile calibrated on the training runs' traces, and its load slowdown."""
    free = [free_share(r) if host_load else 1.0 for r in train]
    cal = calibrate([str(r["trace"]) for r in train], host_cores=host_cores, free=free)
    path = folder / ("multiturn-load.toml" if host_load else "multiturn.toml")
    write_atomic(path, profile_toml(cal, load_hw("a100-pcie"), path.stem))
    return path, cal.load_slowdown if host_load else None


def compare(args) -> list[dict]:
    """Per run, role and host-load use: measured, predicted, error (percent)."""
    train = [r for f in args.train for r in measured(f)]
    test = [r for f in args.test for r in measured(f)]
    host_load = all(r["host_load"] is not None for r in train + test)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for load in (True, False) if host_load else (False,):
            profile, slowdown = fit(train, Path(tmp), args.host_cores, load)
            for role, runs in (("calibration", train), ("held-out", test)):
                for row in runs:
                    got = predict(row, profile, slowdown)
                    rows.append({"role": role, "host_load": load, "folder": row["folder"],
                                 "setting": row["setting"],
                                 "measured": {k: row[k] for k in FIGURES}, "predicted": got,
                                 "error_pct": {k: _err(got[k], row[k]) for k in FIGURES}})
    return rows


def _err(predicted, measured) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return 100.0 * (predicted / measured - 1.0)


def main(argv=None) -> int:
    args = _parse(argv)
    rows = compare(args)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'role':>11} {'load':>5} {'run':>16} {'figure':>26} {'measured':>14} "
          f"{'predicted':>14} {'error %':>8}")
    for row in rows:
        name = f"{Path(row['folder']).name}:{row['setting']}"
        load = "in" if row["host_load"] else "-"
        for k in FIGURES:
            err = row["error_pct"][k]
            print(f"{row['role']:>11} {load:>5} {name:>16} {k:>26} "
                  f"{_cell(row['measured'][k]):>14} {_cell(row['predicted'][k]):>14} "
                  f"{'-' if err is None else f'{err:+.1f}':>8}")
    return 0


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else f"{value:,}"


if __name__ == "__main__":
    sys.exit(main())
