"""Does chunk overlap pay on this machine? Whole vs chunk vs layer, measured side by side.

    python bench/engine_overlap.py                      # CPU, `small`, paced link (~1 min)
    python bench/engine_overlap.py --json
    python bench/engine_overlap.py --model qwen3-0.6b --prompt 8192 --chunk 256 \
        --device cuda --link-gbps 0                     # GPU check (scripts/gpu_check.sh)

Every configuration runs `--repeats` times, interleaved (whole, chunk, layer, one-shot, ...),
and the median of each figure is reported, so slow drift of the machine hits all modes alike.
Ratios and targets (issue 4):
  chunk tail / one span's copy     <= 1.5   (the unhidden tail is about one span)
  chunk handoff / whole handoff    <= 1.0   (overlap never loses)
  chunked prefill / one-shot       the compute overhead of chunking (reported)
  chunk peak staging / span bytes  == max_pending (staging bounded by the ring)
  live checks / run time           < 2%
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import attrs
import torch

from pdgpu.copier import measure_copy_bandwidth
from pdgpu.engine import Engine
from pdgpu.model import build_model
from pdgpu.workload import EngineConfig, Request
from pdref.models import load_model

FIGURES = ("prefill_s", "handoff_s", "tail_s", "copy_s", "peak_staging_bytes", "check_frac",
           "compute_s", "blocked_s", "host_staging_bytes", "source_alloc_bytes")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--max-pending", type=int, default=2)
    p.add_argument("--link-gbps", type=float, default=None,
                   help="pace host->decoder (GB/s); 0 = off; default 0.2 on CPU, off on CUDA")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--decoder-device", default="cpu")
    p.add_argument("--dtype", default=None, help="override the model dtype")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch compute threads (default 1 on CPU: one core computes, one copies)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _configs(args, device: str, link) -> dict[str, EngineConfig]:
    base = EngineConfig("whole", chunk=args.chunk, max_pending=args.max_pending, device=device,
                        decoder_device=args.decoder_device, link_gbps=link)
    return {
        "whole": base,
        "chunk": attrs.evolve(base, mode="chunk"),
        "layer": attrs.evolve(base, mode="layer"),
        "oneshot": attrs.evolve(base, chunk=args.prompt),  # whole, prefill in one chunk
    }


def measure(model, configs: dict, request: Request, repeats: int) -> dict:
    """Median of each figure per configuration, runs interleaved; one warm-up round first."""
    samples: dict[str, list[dict]] = {name: [] for name in configs}
    names = list(configs)
    for round_ in range(repeats + 1):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            metrics = Engine(model, configs[name]).run([request]).metrics
            if round_ > 0:
                samples[name].append(metrics)
    return {name: {k: statistics.median(m[k] or 0 for m in runs) for k in FIGURES}
            for name, runs in samples.items()}


def ratios(med: dict, span_bytes: int, max_pending: int) -> dict:
    chunk, whole = med["chunk"], med["whole"]
    return {
        "chunk_tail_over_span_copy": chunk["tail_s"] / chunk["copy_s"],
        "chunk_tail_over_whole_tail": chunk["tail_s"] / whole["tail_s"],
        "chunk_handoff_over_whole": chunk["handoff_s"] / whole["handoff_s"],
        "layer_handoff_over_whole": med["layer"]["handoff_s"] / whole["handoff_s"],
        "chunked_prefill_overhead": whole["prefill_s"] / med["oneshot"]["prefill_s"] - 1,
        "chunk_staging_spans": chunk["host_staging_bytes"] / span_bytes,
        "chunk_peak_in_flight_spans": chunk["peak_staging_bytes"] / span_bytes,
        "chunk_staging_over_whole": chunk["peak_staging_bytes"] / whole["peak_staging_bytes"],
        "live_check_frac": max(m["check_frac"] for m in med.values()),
        "max_pending": max_pending,
    }


def targets(r: dict) -> dict:
    return {
        "chunk tail <= 1.5 x one span's copy": r["chunk_tail_over_span_copy"] <= 1.5,
        "chunk handoff <= whole handoff": r["chunk_handoff_over_whole"] <= 1.0,
        "chunk staging == max_pending spans": r["chunk_staging_spans"] == r["max_pending"],
        "chunk in flight <= max_pending spans": r["chunk_peak_in_flight_spans"] <= r["max_pending"],
        "live checks < 2% of run time": r["live_check_frac"] < 0.02,
    }


def table(med: dict) -> str:
    cols = ["config", *FIGURES]
    rows = [cols] + [[name, *(f"{m[k]:.4g}" for k in FIGURES)] for name, m in med.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _setup(args):
    """(model, request, device, link) for the arguments."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    link = args.link_gbps if args.link_gbps is not None else (0.2 if device == "cpu" else None)
    if args.threads or device == "cpu":
        torch.set_num_threads(args.threads or 1)
    spec = load_model(args.model)
    spec = attrs.evolve(spec, dtype=args.dtype) if args.dtype else spec
    model = build_model(spec, device=device, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (args.prompt,), generator=gen)
    return model, Request("r0", tuple(tokens.tolist()), 0), device, link or None


def main(argv=None) -> int:
    args = parse_args(argv)
    model, request, device, link = _setup(args)
    spec = model.spec
    med = measure(model, _configs(args, device, link), request, args.repeats)
    span = spec.geometry(16).region_bytes((0, spec.layers), (0, min(args.chunk, args.prompt)))
    r = ratios(med, span, args.max_pending)
    result = {"model": spec.name, "prompt": args.prompt, "chunk": args.chunk, "device": device,
              "link_gbps": link, "threads": torch.get_num_threads(), "repeats": args.repeats,
              "median": med, "ratios": r, "targets": targets(r),
              "copy_bandwidth": measure_copy_bandwidth(device)}
    print(json.dumps(result) if args.json else _text(result))
    return 0


def _text(result: dict) -> str:
    bw = result["copy_bandwidth"]
    lines = [f"{result['model']} prompt={result['prompt']} chunk={result['chunk']} "
             f"device={result['device']} link_gbps={result['link_gbps']} "
             f"threads={result['threads']} (median of {result['repeats']})",
             table(result["median"])]
    lines += [f"{key:>28}: {value:.4f}" for key, value in result["ratios"].items()]
    lines += [f"  [{'ok' if ok else 'MISS'}] {name}" for name, ok in result["targets"].items()]
    lines.append(f"copy bandwidth ({'pinned' if bw['pinned'] else 'pageable'}): "
                 f"d2h {bw['d2h_gbps']:.2f} GB/s, h2d {bw['h2d_gbps']:.2f} GB/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
