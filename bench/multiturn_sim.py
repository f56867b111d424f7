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
pool (its trace header) and cache setting. Per run and figure: measured, predicted, error.
Rows of `--train` folders are calibration (the profile saw their traces), rows of `--test`
folders validation (held out).

Measured figures: the decoder's hit rate (prompt tokens its reserves found cached, `reserve`
`prefix`, over all prompt tokens: pdsim's `prefix_cache_hit_rate`), the producer's hit
tokens (`computed` `hit` pages), bytes handed off (`issue`), from the trace; TTFT p50/p99 and
output tokens/s as the bench's client measured them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FIGURES = ("prefix_cache_hit_rate", "producer_prefix_cache_hits", "bytes", "ttft_p50_s",
           "ttft_p99_s", "tokens_per_s")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=Path, nargs="+", required=True, help="calibrate on these")
    p.add_argument("--test", type=Path, nargs="*", default=[], help="held-out runs")
    p.add_argument("--host-cores", type=int, default=os.cpu_count())
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for folder in [*args.train, *args.test]:
        if not (folder / "report.json").is_file():
            p.error(f"--train/--test: {folder} holds no report.json (bench/multiturn.py "
                    "--trace-dir FOLDER --json > FOLDER/report.json)")
    return args


def trace_figures(trace: Path) -> dict:
    """The run's cache and bytes figures, read from its trace."""
    prompt = prefix = producer = handed = 0
    with trace.open() as f:
        header = json.loads(f.readline())
        page_tokens = header["geometry"]["page_tokens"]
        for line in f:
            e = json.loads(line)
            kind = e["kind"]
            if kind == "reserve":
                prompt, prefix = prompt + e["prompt"], prefix + e["prefix"]
            elif kind == "computed":
                producer += len(e.get("hit") or ()) * page_tokens
            elif kind == "issue":
                handed += e["bytes"]
    return {"prefix_cache_hit_rate": prefix / prompt if prompt else 0.0,
            "producer_prefix_cache_hits": producer, "bytes": handed,
            "pool_pages": header["pool_pages"],
            "producer_cache_pages": header.get("prefix_cache_pages", 0)}


def measured(folder: Path) -> list[dict]:
    """Each cache setting of a bench run: its options, trace figures and client figures."""
    report = json.loads((folder / "report.json").read_text())
    rows = []
    for run in report["runs"]:
        trace = folder / f"{run['setting']}.jsonl"
        rows.append({"folder": str(folder), "setting": run["setting"], "trace": trace,
                     "options": report["options"], **trace_figures(trace),
                     **{k: run[k] for k in ("ttft_p50_s", "ttft_p99_s", "tokens_per_s")}})
    return rows


def pdsim(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pdsim", *argv], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"pdsim {argv[0]} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def cache_flags(row: dict) -> tuple[str, ...]:
    """pdsim's caches as the engine's trace header gave them (the decoder has none yet)."""
    if not row["producer_cache_pages"]:
        return ()
    return ("--producer-cache-pages", str(row["producer_cache_pages"]),
            "--decoder-cache-pages", "0")


def predict(row: dict, profile: Path) -> dict:
    o = row["options"]
    a, b = o["turn_tokens"]
    out = pdsim("run", "--model", o["model"], "--hw", str(profile), "--sessions",
                str(o["sessions"]), "--turns", str(o["turns"]), "--system-prompt",
                str(o["system_prompt"]), "--turn-tokens", f"{a}:{b}", "--output-tokens",
                str(o["output_tokens"]), "--think", str(o["think"]), "--rate", str(o["rate"]),
                "--seed", str(o["seed"]), "--chunk", str(o["chunk"]), "--producers",
                str(o["producers"]), "--pool-pages", str(row["pool_pages"]), "--sender",
                "queued", "--json", "--no-progress", *cache_flags(row))
    sim = {"prefix_cache_hit_rate": 0.0, "producer_prefix_cache_hits": 0,  # no cache: none
           **json.loads(out)}
    return {k: sim.get(k) for k in FIGURES}


def compare(args) -> list[dict]:
    train = [r for f in args.train for r in measured(f)]
    test = [r for f in args.test for r in measured(f)]
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "multiturn.toml"
        pdsim("calibrate", *(str(r["trace"]) for r in train), "-o", str(profile),
              "--host-cores", str(args.host_cores))
        rows = []
        for role, runs in (("calibration", train), ("held-out", test)):
            for row in runs:
                got = predict(row, profile)
                rows.append({"role": role, "folder": row["folder"], "setting": row["setting"],
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
    print(f"{'role':>11} {'run':>24} {'figure':>26} {'measured':>14} {'predicted':>14} "
          f"{'error %':>8}")
    for row in rows:
        name = f"{Path(row['folder']).name}:{row['setting']}"
        for k in FIGURES:
            err = row["error_pct"][k]
            print(f"{row['role']:>11} {name:>24} {k:>26} {_cell(row['measured'][k]):>14} "
                  f"{_cell(row['predicted'][k]):>14} {'-' if err is None else f'{err:+.1f}':>8}")
    return 0


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else f"{value:,}"


if __name__ == "__main__":
    sys.exit(main())
