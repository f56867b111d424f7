"""The seed's serving question on this machine: does chunk (or layer) overlap raise tokens/s
or cut TTFT against whole copies? `pdgpu serve` in-process (one decoder, N producer
processes), the three modes in alternating order over several rounds, one run each.

Reports per mode the median (and min..max) of tokens/s, TTFT p50 (the first token comes from
the producer at `produced`, so no mode can change it), e2e p50 and the handoff tail
(`ready - produced`: the transfer time prefill did not hide), then the per-round ratios
chunk/whole and layer/whole with their spread, and from stage events the share of prefill
compute and link time per request (why overlap can or cannot help here).

    python bench/serve.py                      # small, 1024 tokens, 32 out, conc 4, 2 producers
    python bench/serve.py --rounds 5 --link-gbps 0.05 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdgpu.serve.config import ServeConfig
from pdgpu.serve.launch import ProducerOptions, serve_local
from pdgpu.serve.report import summary
from pdgpu.serve.transport import Endpoint
from pdgpu.serve.workload import Workload, draw_requests
from pdref.metrics import life_metrics
from pdref.models import load_model

MODES = ("whole", "chunk", "layer")


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--link-gbps", type=float, default=0.02)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def one_run(args, mode: str) -> dict:
    spec = load_model(args.model)
    requests, prefix = draw_requests(args.requests, (args.prompt, args.prompt), 0,
                                     args.output_tokens, spec.vocab, seed=0)
    pages = -(-args.prompt // 16)
    config = ServeConfig(args.model, mode, chunk=args.chunk, max_pending=2,
                         pool_pages=pages * args.concurrency, link_gbps=args.link_gbps,
                         source_pages=2 * pages)
    workload = Workload(tuple(requests), prefix, None, args.concurrency)
    run = serve_local(config, workload, args.producers, ProducerOptions(),
                      Endpoint("127.0.0.1", 0))
    out = summary(run.decoder, run.ledger, run.wall_s)
    lives, _ = life_metrics(run.ledger.protocol)
    out["tail_p50_s"] = statistics.median(life.ready_t - life.produced_t for life in lives)
    out["e2e_p50_s"] = statistics.median(t.done_t - t.arrival
                                         for t in run.decoder.tracked.values())
    stages = run.ledger.stages
    for name in ("compute", "link", "decode"):
        out[f"{name}_total_s"] = sum(s.end - s.t for s in stages if s.name == name)
    return out


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def main() -> None:
    args = _args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    start = time.perf_counter()
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            runs[mode].append(one_run(args, mode))
    wall = time.perf_counter() - start
    ratios = {f"{m}/whole": {key: [a[key] / b[key] for a, b in zip(runs[m], runs["whole"],
                                                                   strict=True)]
                             for key in ("tokens_per_s", "ttft_p50_s")}
              for m in ("chunk", "layer")}
    if args.json:
        print(json.dumps({"runs": runs, "ratios": ratios, "bench_wall_s": wall}))
        return
    print(f"{args.model}, {args.prompt}-token prompts, {args.output_tokens} out, "
          f"concurrency {args.concurrency}, {args.producers} producers, chunk {args.chunk}, "
          f"link {args.link_gbps} GB/s, {args.rounds} rounds ({wall:.0f} s)")
    print("| mode | tokens/s | TTFT p50 s | e2e p50 s | handoff tail p50 s | compute s | link s |")
    print("|---|---|---|---|---|---|---|")
    for m in MODES:
        rows = runs[m]
        print(f"| {m} | {_spread([x['tokens_per_s'] for x in rows])} | "
              f"{_spread([x['ttft_p50_s'] for x in rows])} | "
              f"{_spread([x['e2e_p50_s'] for x in rows])} | "
              f"{_spread([x['tail_p50_s'] for x in rows])} | "
              f"{_spread([x['compute_total_s'] for x in rows])} | "
              f"{_spread([x['link_total_s'] for x in rows])} |")
    print("| ratio (per round) | tokens/s | TTFT p50 |")
    print("|---|---|---|")
    for name, values in ratios.items():
        print(f"| {name} | {_spread(values['tokens_per_s'])} | "
              f"{_spread(values['ttft_p50_s'])} |")


if __name__ == "__main__":
    main()
