"""One command run from two source trees (checkouts of two commits) in alternating order,
round by round: medians of chosen JSON figures and the per-round ratio second/first.

Each run is `python CMD...` with the tree first on PYTHONPATH and as the working folder, so
its pdgpu/pdref/pdsim are that tree's (this interpreter's packages otherwise; a tree's
`build/` holds its compiled pdref, used while it matches the tree's sources). The command's
last stdout line must be a JSON object; a key `a.b` reads a nested figure.

    git worktree add --detach /tmp/old OLD && ln -s "$PWD/build" /tmp/old/build  # likewise new
    python bench/tree_ab.py /tmp/old /tmp/new --rounds 3 --keys tokens_per_s,check_s \\
        -- -m pdgpu run --model tiny --mode chunk --prompt 1024 --no-compute --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", help="source tree of the baseline")
    p.add_argument("second", help="source tree compared with it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keys", required=True, help="comma separated JSON figures")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.keys, args.command = args.keys.split(","), argv[cut + 1:]
    if args.rounds < 1 or not args.command:
        p.error("rounds must be >= 1, and the command comes after --")
    return args


def figure(out, key: str) -> float:
    """`key`'s figure in `out` (dots go down a level: a name, or a list's index)."""
    for part in key.split("."):
        out = out[int(part)] if isinstance(out, list) else out[part]
    return float(out)


def one_run(tree: str, command: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run([sys.executable, *command], cwd=tree, env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tree_ab: {tree}: exit {done.returncode}: {done.stderr[-400:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    args = _args()
    runs: dict[str, list[dict]] = {args.first: [], args.second: []}
    for r in range(args.rounds):
        order = [args.first, args.second] if r % 2 == 0 else [args.second, args.first]
        for tree in order:
            runs[tree].append(one_run(tree, args.command))
    report = {}
    for key in args.keys:
        a = [figure(o, key) for o in runs[args.first]]
        b = [figure(o, key) for o in runs[args.second]]
        ratios = [y / x for x, y in zip(a, b, strict=True) if x]
        report[key] = {"first": statistics.median(a), "second": statistics.median(b),
                       "ratio_median": statistics.median(ratios) if ratios else None,
                       "ratios": ratios}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
