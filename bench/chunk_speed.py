"""Does the copy mode or the link's pacing change how fast the engine's prefill chunks run?
The same prompts served as two variants of one `pdsim validate --serving` point, back to back
in alternating order, several rounds (this VM's speed drifts by tens of percent between
minutes, so only side-by-side rounds compare): per run the median prefill chunk time (the
trace's `compute` stages), tokens/s and TTFT p50; per round the ratio of the two variants.

    python bench/chunk_speed.py --pair mode --rounds 6     # chunk vs whole, c1, 256..512 tokens
    python bench/chunk_speed.py --pair pacing --rounds 4   # unpaced vs 0.05 GB/s, c4, chunk mode

Each run is a `pdgpu serve` on the CPU (`small` model): about 12 s. Files under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from pdref.models import load_model
from pdsim.fit.serve_runs import ServePoint, run_serve

PAIRS = {  # the two variants of each pair, the second over the first
    "mode": (ServePoint(1, (256, 512), 32, mode="chunk", requests=8),
             ServePoint(1, (256, 512), 32, mode="whole", requests=8)),
    "pacing": (ServePoint(4, (128, 512), 16, requests=16),
               ServePoint(4, (128, 512), 16, link_gbps=0.05, requests=16)),
}


def chunk_times(trace: str) -> list[float]:
    """Every prefill chunk's time (s): the trace's `compute` stages."""
    with open(trace, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [r["end"] - r["t"] for r in rows
            if r.get("kind") == "stage" and r.get("name") == "compute"]


def one_run(point: ServePoint, vocab: int, folder: Path) -> dict:
    run = run_serve(point, "small", vocab, folder)
    return {"point": point.name, "chunk_ms_p50": 1000 * statistics.median(chunk_times(run.trace)),
            "tokens_per_s": run.summary["tokens_per_s"], "ttft_p50_s": run.summary["ttft_p50_s"]}


def alternate(pair: str, rounds: int, out: Path) -> dict:
    """`rounds` rounds, the variants' order flipped every round; per run and per round."""
    first, second = PAIRS[pair]
    vocab = load_model("small").vocab
    runs, ratios = [], []
    for r in range(rounds):
        order = (first, second) if r % 2 == 0 else (second, first)
        done = {p.name: one_run(p, vocab, out / f"round{r}" / p.name) for p in order}
        runs += [{"round": r, **done[p.name]} for p in order]
        ratios.append(done[second.name]["chunk_ms_p50"] / done[first.name]["chunk_ms_p50"])
        print(f"round {r}: {second.name} / {first.name} chunk time {ratios[-1]:.3f}",
              file=sys.stderr, flush=True)
    return {"pair": pair, "first": first.name, "second": second.name, "runs": runs,
            "chunk_ratio_per_round": ratios, "chunk_ratio_median": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", choices=sorted(PAIRS), default="mode")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", type=Path, default=None, help="run folders (default: a temp dir)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        result = alternate(args.pair, args.rounds, args.out or Path(tmp))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
