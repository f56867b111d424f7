"""Whole `pdsim sweep` commands: the process pool vs `--ray` (a local cluster), side by side.

Each round runs the same grid both ways as separate processes (so Ray's start and shutdown are
counted, as a user pays them), alternating which goes first, checks both wrote the same CSV,
and prints the median wall time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRIDS = {
    "small": ["--modes", "layer,chunk", "--prompts", "16384,512", "--chunks", "64,256,1024",
              "--max-pending", "1,2"],
    "large": ["--modes", "whole,chunk,layer", "--prompts", "1024,2048,4096,8192,16384",
              "--chunks", "64,128,256,512,1024,2048", "--max-pending", "1,2,4,8",
              "--bandwidths", "0.25,0.35,0.5,0.7,1,1.4,2,2.8,4,5.6"],
}


def timed_sweep(grid: list[str], csv: Path, extra: list[str], jobs: int) -> float:
    argv = [sys.executable, "-m", "pdsim.cli", "sweep", *grid, "--quiet", "--jobs", str(jobs),
            "--csv", str(csv), *extra]
    start = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - start


def compare(name: str, rounds: int, jobs: int, folder: Path) -> dict:
    grid, walls = GRIDS[name], {"pool": [], "ray": []}
    ways = {"pool": [], "ray": ["--ray"]}
    for r in range(rounds):
        for way in (("pool", "ray") if r % 2 == 0 else ("ray", "pool")):
            walls[way].append(timed_sweep(grid, folder / f"{way}.csv", ways[way], jobs))
        if (folder / "pool.csv").read_bytes() != (folder / "ray.csv").read_bytes():
            raise SystemExit(f"{name}: --ray wrote other rows than the pool")
    configs = (folder / "pool.csv").read_text().count("\n") - 1
    pool, ray = statistics.median(walls["pool"]), statistics.median(walls["ray"])
    return {"grid": name, "configs": configs, "pool_s": pool, "ray_s": ray,
            "ray_over_pool": ray / pool, "pool_runs_s": walls["pool"], "ray_runs_s": walls["ray"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="runs of each way per grid")
    p.add_argument("--jobs", type=int, default=2, help="pool processes = local Ray CPUs")
    p.add_argument("--grids", default="small,large", help="which grids, comma separated")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        for name in args.grids.split(","):
            f = compare(name, args.rounds, args.jobs, Path(folder))
            print(f"{f['grid']:6} {f['configs']:6d} configs: pool {f['pool_s']:.2f} s, "
                  f"ray {f['ray_s']:.2f} s, ray/pool {f['ray_over_pool']:.2f}x  "
                  f"(pool {', '.join(f'{w:.2f}' for w in f['pool_runs_s'])}; "
                  f"ray {', '.join(f'{w:.2f}' for w in f['ray_runs_s'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
