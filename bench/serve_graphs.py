"""The served decode step, eager against replayed as CUDA graphs (issue 34): `pdgpu serve`
in-process (one decoder, N producer processes), `--batch` requests at once, each `--graphs`
setting in alternating order round by round, the same requests every run.

The figure is the ITL at the full batch: the median wall time of the decoder's decode steps
whose batch is `--batch` (the trace's `decode` stages: every running request gets one token
per step; where requests end before the last one joins, the widest batch that ran, said
under the table), with the target beside it (8 ms at batch 16 for qwen3-0.6b on an H200, goal 5),
and the ratio replayed/eager per round. The summary's itl_p50_s (every step, at any batch,
prefill arrivals between them included) and the layouts captured come with it; the first
step of a new layout includes its capture.

    python bench/serve_graphs.py --device cuda:0 --model qwen3-0.6b   # the GPU figure
    python bench/serve_graphs.py --model tiny --contexts 16:64 --output-tokens 8 \\
        --graphs off,auto                                          # CPU: the commands work
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdgpu.serve.config import ServeConfig
from pdgpu.serve.launch import ProducerOptions, serve_local
from pdgpu.serve.report import summary
from pdgpu.serve.transport import Endpoint
from pdgpu.serve.workload import Workload, draw_requests
from pdref.events import Stage
from pdref.models import load_model
from pdref.trace import read_trace

TARGET_MS, GOAL_MS = 8.0, 5.0  # ITL at batch 16, qwen3-0.6b on an H200 (issue 34)


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--device", default="cpu", help="the producers' device")
    p.add_argument("--decoder-device", help="the decoder's (default: --device)")
    p.add_argument("--batch", type=int, default=16, help="requests at once")
    p.add_argument("--contexts", default="1024:4096", help="drawn prompt lengths A:B")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--graphs", default="off,on", help="--cuda-graphs settings, side by side")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.decoder_device = args.decoder_device or args.device
    args.graphs = args.graphs.split(",")
    lo, hi = (int(x) for x in args.contexts.split(":"))
    args.context_range = (lo, hi)
    return args


def one_run(args, graphs: str) -> dict:
    """One served run: the full-batch decode steps' median and p90 (ms), the summary."""
    spec = load_model(args.model)
    requests, prefix = draw_requests(args.batch, args.context_range, 0, args.output_tokens,
                                     spec.vocab, seed=0)
    pages = -(-(args.context_range[1] + args.output_tokens) // 16)
    config = ServeConfig(args.model, "chunk", chunk=args.chunk, pool_pages=pages * args.batch,
                         source_pages=2 * pages, cuda_graphs=graphs)
    workload = Workload(tuple(requests), prefix, None, args.batch)
    run = serve_local(config, workload, args.producers, ProducerOptions(device=args.device),
                      Endpoint("127.0.0.1", 0), decoder_device=args.decoder_device)
    run.ledger.log.close()  # the trace is written while the run goes: read back
    out = summary(run.decoder, run.ledger, run.wall_s)
    steps = [e for _, e in read_trace(run.ledger.log.path)
             if type(e) is Stage and e.name == "decode"]
    run.ledger.log.discard()
    if not steps:
        raise SystemExit("serve_graphs: no decode step ran")
    # the widest batch that ran: on a fast decoder the first requests may finish before the
    # last one joins, so `--batch` is a ceiling; the report names the batch it measured
    widest = max(e.batch for e in steps)
    full = [1e3 * (e.end - e.t) for e in steps if e.batch == widest]
    out["full_batch"], out["full_steps"] = widest, len(full)
    out["itl_full_ms"] = statistics.median(full)
    out["itl_full_p90_ms"] = statistics.quantiles(full, n=10)[-1] if len(full) > 1 else full[0]
    out["replayed"] = out["decode_graph_captures"] is not None
    return out


def main() -> None:
    args = _args()
    runs: dict[str, list[dict]] = {g: [] for g in args.graphs}
    start = time.perf_counter()
    for r in range(args.rounds):
        for graphs in (args.graphs if r % 2 == 0 else args.graphs[::-1]):
            runs[graphs].append(one_run(args, graphs))
    wall = time.perf_counter() - start
    if args.json:
        print(json.dumps({"runs": runs, "bench_wall_s": wall}))
        return
    device = (torch.cuda.get_device_name(torch.device(args.decoder_device))
              if args.decoder_device.startswith("cuda") else "cpu")
    print(f"{args.model}, batch {args.batch}, prompts {args.contexts}, {args.output_tokens} "
          f"out, decoder {args.decoder_device} ({device}), {args.rounds} rounds ({wall:.0f} s)")
    print(f"| --cuda-graphs | ran | ITL at batch {args.batch}, median ms | p90 ms | steps | "
          f"itl_p50_s (all steps) | layouts captured | target (batch 16, H200) |")
    print("|---|---|---|---|---|---|---|---|")
    for graphs, rows in runs.items():
        ran = "replayed" if rows[0]["replayed"] else "eager"
        cells = [_spread([x[k] for x in rows]) for k in ("itl_full_ms", "itl_full_p90_ms")]
        print(f"| {graphs} | {ran} | {cells[0]} | {cells[1]} | "
              f"{rows[0]['full_steps']} | {_spread([x['itl_p50_s'] for x in rows], 4)} | "
              f"{rows[0]['decode_graph_captures'] or '-'} | <= {TARGET_MS:g} ms "
              f"(goal {GOAL_MS:g}) |")
    short = sorted({x["full_batch"] for rows in runs.values() for x in rows} - {args.batch})
    if short:
        print(f"note: some rounds' batch reached only {short} of {args.batch} (requests ended "
              f"before the last joined): their ITL is at that batch")
    if len(args.graphs) == 2:
        a, b = args.graphs
        ratios = [x["itl_full_ms"] / y["itl_full_ms"] for x, y in zip(runs[b], runs[a],
                                                                       strict=True)]
        print(f"ITL at batch {args.batch}, {b}/{a} per round: {_spread(ratios)}")


def _spread(values: list[float], digits: int = 2) -> str:
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}..{max(values):.{digits}f})")


if __name__ == "__main__":
    main()
