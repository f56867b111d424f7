"""The seed's serving question on this machine: does chunk (or layer) overlap raise tokens/s
or cut TTFT against whole copies? `pdgpu serve` in-process (one decoder, N producer
processes), the three modes in alternating order over several rounds, one run each.

Reports per mode the median (and min..max) of tokens/s, TTFT p50 (the first token comes from
the producer at `produced`, so no mode can change it), e2e p50 and the handoff tail
(`ready - produced`: the transfer time prefill did not hide), then the per-round ratios
chunk/whole and layer/whole with their spread, and from stage events the share of prefill
compute and link time per request (why overlap can or cannot help here).

Side by side in the same run (issue 24): each `--lanes` (how KV crosses between processes:
gloo over TCP, or shared memory) and each `--verify` setting, ratios per round: shm/gloo
tokens/s and ITL p50, verify on/off tokens/s and TTFT p50; and the decoder's own time checking
landed bytes as a share of the run's wall (what --verify adds to the serving loop), and its
live checks' share (pdref's fast mirror in line; the full Monitor audits behind it). And the
lane itself: KV bytes/s between two processes (`--lane-mb` MB messages, the reader copying
each out like the decoder into its pool) against a same-size memcpy in one process (CUDA: the
pinned copy bandwidth).

    python bench/serve.py                      # small, 1024 tokens, 32 out, conc 4, 2 producers
    python bench/serve.py --rounds 5 --link-gbps 0.05 --json
    python bench/serve.py --modes chunk --lanes gloo,shm --verify on,off --link-gbps 0
    python bench/serve.py --modes chunk --lanes gloo,shm,nixl --link-gbps 0  # issue 26
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pdgpu.serve.config import ServeConfig
from pdgpu.serve.lane_probe import copy_rate, transfer_rate
from pdgpu.serve.launch import ProducerOptions, serve_local
from pdgpu.serve.report import summary
from pdgpu.serve.transport import Endpoint
from pdgpu.serve.workload import Workload, draw_requests
from pdref.events import Stage
from pdref.metrics import life_metrics
from pdref.models import load_model
from pdref.trace import read_trace

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
    p.add_argument("--link-gbps", type=float, default=0.02, help="0: unpaced")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help="comma separated ('': the lane "
                   "probe only)")
    p.add_argument("--lanes", default="shm", help="gloo,shm: both, side by side (nixl: "
                   "NIXL, with the nixl extra)")
    p.add_argument("--verify", default="on", help="on,off: both, side by side")
    p.add_argument("--device", default="cpu", help="producers' and decoder's device")
    p.add_argument("--lane-mb", type=float, default=16.0, help="lane probe message MB (0: none)")
    p.add_argument("--lane-messages", type=int, default=60)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    args.lanes = args.lanes.split(",")
    args.verify = [v == "on" for v in args.verify.split(",")]
    return args


def variants(args, r: int) -> list[tuple[str, str, bool]]:
    """(mode, lane, verify) of every run, in alternating order round by round."""
    out = [(m, lane, v) for m in args.modes for lane in args.lanes for v in args.verify]
    return out if r % 2 == 0 else out[::-1]


def name(variant) -> str:
    mode, lane, verify = variant
    return f"{mode} {lane}{'' if verify else ' no-verify'}"


def one_run(args, mode: str, lane: str = "shm", verify: bool = True) -> dict:
    spec = load_model(args.model)
    requests, prefix = draw_requests(args.requests, (args.prompt, args.prompt), 0,
                                     args.output_tokens, spec.vocab, seed=0)
    pages = -(-args.prompt // 16)
    config = ServeConfig(args.model, mode, chunk=args.chunk, max_pending=2,
                         pool_pages=pages * args.concurrency, link_gbps=args.link_gbps or None,
                         source_pages=2 * pages, verify=verify)
    workload = Workload(tuple(requests), prefix, None, args.concurrency)
    opts = ProducerOptions(device=args.device, kv_lane=lane)
    run = serve_local(config, workload, args.producers, opts, Endpoint("127.0.0.1", 0),
                      decoder_device=args.device)
    run.ledger.log.close()  # the trace is written while the run goes: read back
    out = summary(run.decoder, run.ledger, run.wall_s)
    lives, _ = life_metrics(run.ledger.log.protocol())
    out["tail_p50_s"] = statistics.median(life.ready_t - life.produced_t for life in lives)
    out["e2e_p50_s"] = statistics.median(t.done_t - t.arrival
                                         for t in run.decoder.tracked.values())
    stages = [e for _, e in read_trace(run.ledger.log.path) if type(e) is Stage]
    for stage in ("compute", "link", "decode"):
        out[f"{stage}_total_s"] = sum(s.end - s.t for s in stages if s.name == stage)
    run.ledger.log.discard()
    out["verify_pct"] = 100 * out["verify_s"] / out["wall_s"]  # the decoder's loop, checking
    out["check_pct"] = 100 * out["check_frac"]  # the decoder's live checks (pdref's mirror)
    return out


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def _ratios(runs: dict, args) -> dict:
    """Per-round ratios: modes against whole, shm against gloo, verify on against off."""
    pairs = {}
    first_lane, on = args.lanes[-1], args.verify[0]
    for m in ("chunk", "layer"):
        pairs[f"{m}/whole ({first_lane})"] = ((m, first_lane, on), ("whole", first_lane, on))
    for m in args.modes:
        pairs[f"{m}: shm/gloo"] = ((m, "shm", on), (m, "gloo", on))
        pairs[f"{m}: nixl/shm"] = ((m, "nixl", on), (m, "shm", on))
        pairs[f"{m}: verify on/off"] = ((m, first_lane, True), (m, first_lane, False))
    keys = ("tokens_per_s", "ttft_p50_s", "itl_p50_s")
    return {label: {k: [x[k] / y[k] for x, y in zip(runs[a], runs[b], strict=True)]
                    for k in keys}
            for label, (a, b) in pairs.items() if a in runs and b in runs and a != b}


def lane_bytes(args) -> dict:
    """KV bytes/s between two processes per lane against a same-size memcpy, interleaved
    round by round; GB/s and the ratio, medians."""
    nbytes = int(args.lane_mb * 2**20)
    out: dict[str, list[float]] = {"memcpy": []}
    for _ in range(args.rounds):
        out["memcpy"].append(copy_rate(nbytes, args.device) / 1e9)
        for lane in args.lanes:
            rate, agreed = transfer_rate(lane, nbytes, args.lane_messages, args.device)
            out.setdefault(agreed, []).append(rate / 1e9)
            if lane in ("shm", "nixl"):  # as the producer sends: gathered straight in
                rate, agreed = transfer_rate(lane, nbytes, args.lane_messages, args.device,
                                             staged=True)
                out.setdefault(f"{agreed} (gathered in)", []).append(rate / 1e9)
    return {lane: {"gb_s": statistics.median(v),
                   "of_memcpy": statistics.median(v) / statistics.median(out["memcpy"])}
            for lane, v in out.items()}


def main() -> None:
    args = _args()
    runs: dict[tuple, list[dict]] = {}
    start = time.perf_counter()
    lanes = lane_bytes(args) if args.lane_mb else {}
    for r in range(args.rounds):
        for variant in variants(args, r):
            runs.setdefault(variant, []).append(one_run(args, *variant))
    wall = time.perf_counter() - start
    ratios = _ratios(runs, args)
    if args.json:
        print(json.dumps({"runs": {name(v): x for v, x in runs.items()}, "ratios": ratios,
                          "lane_bytes": lanes, "bench_wall_s": wall}))
        return
    print(f"{args.model}, {args.prompt}-token prompts, {args.output_tokens} out, "
          f"concurrency {args.concurrency}, {args.producers} producers, chunk {args.chunk}, "
          f"link {args.link_gbps or 'unpaced'} GB/s, {args.device}, {args.rounds} rounds "
          f"({wall:.0f} s)")
    _print_lanes(args, lanes)
    if runs:
        _print_runs(runs, ratios)


def _print_runs(runs: dict, ratios: dict) -> None:
    print("| run | tokens/s | TTFT p50 s | ITL p50 s | e2e p50 s | handoff tail p50 s | "
          "compute s | link s | verify % of wall | live checks % of wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant, rows in runs.items():
        cells = [_spread([x[k] for x in rows]) for k in (
            "tokens_per_s", "ttft_p50_s", "itl_p50_s", "e2e_p50_s", "tail_p50_s",
            "compute_total_s", "link_total_s", "verify_pct", "check_pct")]
        print(f"| {name(variant)} | " + " | ".join(cells) + " |")
    print("| ratio (per round) | tokens/s | TTFT p50 | ITL p50 |")
    print("|---|---|---|---|")
    for label, values in ratios.items():
        print(f"| {label} | {_spread(values['tokens_per_s'])} | "
              f"{_spread(values['ttft_p50_s'])} | {_spread(values['itl_p50_s'])} |")


def _print_lanes(args, lanes: dict) -> None:
    if not lanes:
        return
    base = "memcpy" if args.device == "cpu" else "pinned d2h"
    print(f"KV bytes between processes, {args.lane_mb:g} MB messages x "
          f"{args.lane_messages}, medians of {args.rounds} (target shm >= 0.50 of {base}):")
    print(f"| lane | GB/s | of {base} |")
    print("|---|---|---|")
    for lane, v in lanes.items():
        print(f"| {lane if lane != 'memcpy' else base} | {v['gb_s']:.2f} | "
              f"{v['of_memcpy']:.2f} |")


if __name__ == "__main__":
    main()
