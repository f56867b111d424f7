"""Simulator speed: events per second, a 10,000-config sweep, a 10,000-request workload, and
the whole `pdsim run` process on that workload (start-up and imports included).

    python bench/sim_speed.py                   # full figures (a few minutes on 2 cores)
    python bench/sim_speed.py --quick           # a tenth of the sizes
    python bench/sim_speed.py --process-only    # only the whole-process figure
    python bench/sim_speed.py --process-only --baseline DIR   # and another checkout's, in
                                                # alternating rounds (DIR: its repository root)
    python bench/sim_speed.py --scaling 10000,100000,1000000  # one whole process per count:
                                                # wall, CPU and peak RSS (minutes at 1M)

Every simulated event goes through pdref's Monitor (the spec), as in any pdsim run; decode
steps are recorded by the decoder, checked in one batch (`Monitor.recorded_stages`) and
written as `decode` stages by the trace writer.
The whole-process figure reports wall and CPU seconds (medians): on a shared machine the CPU
time moves less with other work; and the peak resident memory of the process (its own
`ru_maxrss`, from wait4), which a workload run keeps flat: it holds only the requests in
flight (pdsim/core/stream.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import attrs

from pdref import accel
from pdref.models import load_model
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import costs_for, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.metrics import workload_metrics
from pdsim.core.play import simulate
from pdsim.core.profiles import load_hw, load_link
from pdsim.core.workload import WorkloadSpec, build_requests
from pdsim.sweep import Point, run_sweep


def base_config() -> SimConfig:
    spec = load_model("qwen3-0.6b")
    hw = load_hw("a100-pcie")
    costs = costs_for(spec, hw, load_link(hw.link), load_engine("seed-eager"))
    return SimConfig(sim_geometry(spec), costs, "chunk", 256, pool_pages=1024)


def events_per_second(base: SimConfig, repeats: int) -> dict:
    """One 8192-token request, chunk 64, with stage events, run `repeats` times."""
    cfg = attrs.evolve(base, chunk=64)
    start, events = time.perf_counter(), 0
    for _ in range(repeats):
        events += len(simulate(cfg, [RequestSpec("r0", 0.0, 8192)]).events)
    wall = time.perf_counter() - start
    return {"events": events, "wall_s": wall, "events_per_s": events / wall}


def sweep_points(count: int) -> list[Point]:
    """chunk 64..2048 (step 16) x modes chunk/layer x max_pending 1..4 x bandwidth scales."""
    chunks = range(64, 2049, 16)
    bandwidths = [0.25 * 1.4**i for i in range(10)]
    points = [Point(mode, 8192, c, p, b) for c in chunks for mode in ("chunk", "layer")
              for p in (1, 2, 3, 4) for b in bandwidths]
    return points[:: max(1, len(points) // count)][:count]


TARGET_SWEEP_S = 60.0  # issue 3: a 10,000-config sweep of 8192-token prompts (was a slow test)


def sweep_speed(base: SimConfig, count: int, jobs: int) -> dict:
    points = sweep_points(count)
    start = time.perf_counter()
    rows = run_sweep(base, points, jobs=jobs, progress=False)
    wall = time.perf_counter() - start
    target = TARGET_SWEEP_S * count / 10_000
    return {"configs": len(rows), "jobs": jobs, "wall_s": wall, "configs_per_s": len(rows) / wall,
            "target_wall_s": target, "meets_target": wall <= target}


def workload_speed(base: SimConfig, count: int, stages: bool) -> dict:
    """Poisson arrivals, prompts uniform 512..8192, chunk 256, one span per chunk."""
    spec = WorkloadSpec(requests=count, prompt_range=(512, 8192), rate=2.0, seed=1)
    requests = build_requests(spec, base.geometry.page_tokens)
    cfg = attrs.evolve(base, pool_pages=16 * 512, output_tokens=64, stages=stages)
    start = time.perf_counter()
    result = simulate(cfg, requests)
    wall = time.perf_counter() - start
    m = workload_metrics(result)
    return {"requests": count, "spans": m["spans"], "events": len(result.events),
            "stages": stages, "wall_s": wall, "requests_per_s": count / wall,
            "events_per_s": len(result.events) / wall}


TARGET_PROCESS_RPS = 2500  # issue 12: simulated requests per second, whole process


def process_command(count: int) -> list[str]:
    """The issue's workload: Poisson arrivals, prompts 512..8192, 65 output tokens each."""
    return [sys.executable, "-m", "pdsim", "run", "--model", "qwen3-0.6b", "--hw", "h200",
            "--requests", str(count), "--rate", "2", "--prompt-range", "512:8192",
            "--output-tokens", "65", "--json"]


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _timed_process(count: int, root: str | None) -> tuple[float, float, float, str]:
    """Wall and CPU seconds and peak RSS (MB) of one whole `pdsim run` process, and its
    output. `root`: run that checkout's code instead (PYTHONPATH), for side-by-side rounds.
    CPU time moves less than wall time when other work shares the cores."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = root
    start, cpu = time.perf_counter(), _cpu_s()
    command = [*process_command(count), "--no-progress"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, env=env, cwd=root,
                          text=True) as proc:
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, command)
    return time.perf_counter() - start, _cpu_s() - cpu, usage.ru_maxrss / 1024, out


def compile_bytecode(root: str | None) -> None:
    """Compile a checkout's sources to bytecode first, as an installed package has them:
    where PYTHONDONTWRITEBYTECODE is set (as on the VM these figures come from), every
    process would otherwise compile pdref and pdsim again (about 60 ms of each run)."""
    here = root if root is not None else os.path.dirname(os.path.dirname(__file__)) or "."
    subprocess.run([sys.executable, "-m", "compileall", "-q", "pdref", "pdsim"], cwd=here,
                   check=True, capture_output=True)


def process_speed(count: int, rounds: int, baseline: str | None = None) -> dict:
    """Whole-process requests per second, median of `rounds`; with `baseline`, that checkout
    runs in alternating rounds and its summary must be identical. Both are compiled to
    bytecode first (`compile_bytecode`). `compiled_modules`: whether this checkout's hot
    modules ran compiled (pdref/accel.py; PD_PURE_PYTHON=1 for the pure-Python figure)."""
    for root in (None, baseline) if baseline is not None else (None,):
        compile_bytecode(root)
    walls: dict[str, list[float]] = {"this": [], "baseline": []}
    cpus: dict[str, list[float]] = {"this": [], "baseline": []}
    rss: list[float] = []
    outputs = set()
    for _ in range(rounds):
        for name, root in (("this", None), ("baseline", baseline)):
            if name == "baseline" and baseline is None:
                continue
            wall, cpu, peak, out = _timed_process(count, root)
            if name == "this":
                rss.append(peak)
            walls[name].append(wall)
            cpus[name].append(cpu)
            outputs.add(out)
    median, cpu = statistics.median(walls["this"]), statistics.median(cpus["this"])
    out = {"command": " ".join(["pdsim"] + process_command(count)[3:]), "rounds": rounds,
           "wall_s": [round(w, 3) for w in walls["this"]], "median_s": round(median, 3),
           "requests_per_s": round(count / median), "target_requests_per_s": TARGET_PROCESS_RPS,
           "meets_target": count / median >= TARGET_PROCESS_RPS,
           "cpu_s": [round(c, 3) for c in cpus["this"]], "median_cpu_s": round(cpu, 3),
           "requests_per_cpu_s": round(count / cpu), "peak_rss_mb": round(max(rss)),
           "load_avg": os.getloadavg()[0],
           "bytecode": "compiled first", "compiled_modules": accel.status()}
    if baseline is not None:
        base, base_cpu = (statistics.median(walls["baseline"]),
                          statistics.median(cpus["baseline"]))
        out.update(baseline_wall_s=[round(w, 3) for w in walls["baseline"]],
                   baseline_median_s=round(base, 3), baseline_requests_per_s=round(count / base),
                   speedup=round(base / median, 2),
                   baseline_cpu_s=[round(c, 3) for c in cpus["baseline"]],
                   baseline_median_cpu_s=round(base_cpu, 3), cpu_speedup=round(base_cpu / cpu, 2),
                   same_summary=len(outputs) == 1)
    return out


def scaling(counts: list[int]) -> list[dict]:
    """One whole process per request count (the issue's workload): wall and CPU seconds and
    peak RSS; memory should stay flat and time grow linearly."""
    compile_bytecode(None)
    rows = []
    for count in counts:
        wall, cpu, peak, out = _timed_process(count, None)
        rows.append({"requests": count, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                     "cpu_us_per_request": round(1e6 * cpu / count), "peak_rss_mb": round(peak),
                     "ttft_p99_s": json.loads(out)["ttft_p99_s"],
                     "load_avg": round(os.getloadavg()[0], 1)})
    return rows


def _counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tenth of the sizes")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--process-only", action="store_true",
                   help="only the whole `pdsim run` process figure")
    p.add_argument("--rounds", type=int, default=3, help="whole-process rounds (median)")
    p.add_argument("--baseline", default=None,
                   help="another checkout's root: its whole process too, alternating rounds")
    p.add_argument("--scaling", type=_counts, default=None, metavar="N,N,...",
                   help="only the whole process at each request count: wall, CPU, peak RSS")
    args = p.parse_args(argv)
    scale = 10 if args.quick else 1
    figures = {"cpu_count": os.cpu_count()}
    if args.scaling:
        figures["scaling"] = scaling(args.scaling)
        print(json.dumps(figures, indent=1))
        return 0
    if not args.process_only:
        base = base_config()
        figures.update(
            single=events_per_second(base, 200 // scale),
            sweep=sweep_speed(base, 10_000 // scale, args.jobs),
            workload=workload_speed(base, 10_000 // scale, stages=True),
            workload_no_stages=workload_speed(base, 10_000 // scale, stages=False),
        )
    figures["process"] = process_speed(10_000 // scale, args.rounds, args.baseline)
    text = json.dumps(figures, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
