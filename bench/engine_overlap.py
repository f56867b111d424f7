"""Does chunk overlap pay on this machine? Whole vs chunk vs layer, measured side by side.

    python bench/engine_overlap.py                      # CPU, `small`, paced link (~1 min)
    python bench/engine_overlap.py --json
    python bench/engine_overlap.py --model qwen3-0.6b --prompt 8192 --chunk 256 \
        --device cuda --link-gbps 0                     # GPU check (scripts/gpu_check.sh)

Every configuration runs `--repeats` times, interleaved (whole, chunk, layer, one-shot, ...);
figures are medians and ratios are medians of ratios taken within a round, so slow drift of
a shared machine hits all modes alike.
Ratios and targets (issue 4):
  chunk tail / one span's copy     <= 1.5   (the unhidden tail is about one span)
  chunk handoff / whole handoff    <= 1.0   (overlap never loses)
  chunked prefill / one-shot       the compute overhead of chunking (reported)
  chunk staging / span bytes       == max_pending (staging bounded by the ring)
  live checks / run time           < 2%
Also: export only (the copier alone, no compute), whole vs chunked copy of the same bytes,
and the measured copy bandwidth (pinned on CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import attrs
import torch

from pdgpu.copier import Copier, CopierConfig, CopyJob, measure_copy_bandwidth
from pdgpu.decoder_pool import DecoderPool
from pdgpu.engine import Engine
from pdgpu.model import build_model, torch_dtype
from pdgpu.source_cache import SourceCache
from pdgpu.workload import EngineConfig, Request
from pdref.models import load_model
from pdref.plan import plan_spans

FIGURES = ("prefill_s", "handoff_s", "tail_s", "copy_s", "peak_staging_bytes", "check_frac",
           "compute_s", "blocked_s", "host_staging_bytes", "source_alloc_bytes", "threads")


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
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None,
                   help="torch compute threads (default: the engine's, one core left to copy)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the JSON result to this file")
    return p.parse_args(argv)


def _configs(args, device: str, link) -> dict[str, EngineConfig]:
    base = EngineConfig("whole", chunk=args.chunk, max_pending=args.max_pending, device=device,
                        decoder_device=args.decoder_device, link_gbps=link, threads=args.threads)
    return {
        "whole": base,
        "chunk": attrs.evolve(base, mode="chunk"),
        "layer": attrs.evolve(base, mode="layer"),
        "oneshot": attrs.evolve(base, chunk=args.prompt),  # whole, prefill in one chunk
    }


def measure(model, configs: dict, request: Request, repeats: int) -> list[dict]:
    """`repeats` rounds of every configuration (order rotated each round), after a warm-up
    round; each round maps config name -> metrics."""
    names, rounds = list(configs), []
    for i in range(repeats + 1):
        order = names[i % len(names):] + names[:i % len(names)]
        rounds.append({name: Engine(model, configs[name]).run([request]).metrics
                       for name in order})
    return rounds[1:]


def medians(rounds: list[dict]) -> dict:
    return {name: {k: statistics.median(r[name][k] or 0 for r in rounds) for k in FIGURES}
            for name in rounds[0]}


def _paired(rounds: list[dict], fn) -> float:
    """Median over rounds of a ratio taken within each round (drift cancels)."""
    return statistics.median(fn(r) for r in rounds)


def spread(rounds: list[dict]) -> dict:
    """Min and max over rounds of the handoff ratios: how much the machine's noise moves them."""
    out = {}
    for mode in ("chunk", "layer"):
        values = [r[mode]["handoff_s"] / r["whole"]["handoff_s"] for r in rounds]
        out[f"{mode}_handoff_over_whole"] = (min(values), max(values))
    return out


def ratios(rounds: list[dict], span_bytes: int, max_pending: int) -> dict:
    med = medians(rounds)
    return {
        "chunk_tail_over_span_copy": _paired(rounds, lambda r: r["chunk"]["tail_s"]
                                             / r["chunk"]["copy_s"]),
        "chunk_tail_over_whole_tail": _paired(rounds, lambda r: r["chunk"]["tail_s"]
                                              / r["whole"]["tail_s"]),
        "chunk_handoff_over_whole": _paired(rounds, lambda r: r["chunk"]["handoff_s"]
                                            / r["whole"]["handoff_s"]),
        "layer_handoff_over_whole": _paired(rounds, lambda r: r["layer"]["handoff_s"]
                                            / r["whole"]["handoff_s"]),
        "chunked_prefill_overhead": _paired(rounds, lambda r: r["whole"]["prefill_s"]
                                            / r["oneshot"]["prefill_s"] - 1),
        "chunk_staging_spans": med["chunk"]["host_staging_bytes"] / span_bytes,
        "chunk_peak_in_flight_spans": med["chunk"]["peak_staging_bytes"] / span_bytes,
        "chunk_staging_over_whole": med["chunk"]["peak_staging_bytes"]
        / med["whole"]["peak_staging_bytes"],
        "live_check_frac": max(m["check_frac"] for m in med.values()),
        "max_pending": max_pending,
    }


def _export_s(copier: Copier, spans, src, slab, max_pending: int) -> float:
    """Wall time to copy every span with at most max_pending in flight (no compute)."""
    start = time.perf_counter()
    for i, region in enumerate(spans):
        if copier.in_flight >= max_pending:
            copier.wait()
        copier.submit(CopyJob(i, "x", region.layers, region.tokens, src.slots, slab,
                              copier.mark_ready()))
    copier.drain()
    return time.perf_counter() - start


def export_only(spec, args, device: str, decoder: str) -> dict:
    """Copier alone over a filled source cache: whole vs chunked export of the same bytes
    (the brief: with no compute to hide behind, per-span overheads make chunks slower)."""
    geometry = spec.geometry(16)
    pages, dtype = geometry.pages_for(args.prompt), torch_dtype(spec)
    source = SourceCache(geometry, pages, device, dtype)
    pool = DecoderPool(geometry, pages, decoder, dtype)
    src = source.open(args.prompt)
    slab = pool.slab(src.pages, 0, args.prompt)
    out = {}
    for mode in ("whole", "chunk"):
        spans = plan_spans(mode, geometry, args.prompt, 0, args.chunk)
        elems = max(r.bytes(geometry) for r in spans) // geometry.dtype_bytes
        copier = Copier(CopierConfig(args.max_pending, elems), source.kv, pool, time.perf_counter)
        try:
            out[f"export_{mode}_s"] = min(_export_s(copier, spans, src, slab, args.max_pending)
                                          for _ in range(3))
        finally:
            copier.close()
    out["export_chunk_over_whole"] = out["export_chunk_s"] / out["export_whole_s"]
    return out


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
    rounds = measure(model, _configs(args, device, link), request, args.repeats)
    span = spec.geometry(16).region_bytes((0, spec.layers), (0, min(args.chunk, args.prompt)))
    med, r = medians(rounds), ratios(rounds, span, args.max_pending)
    result = {"model": spec.name, "prompt": args.prompt, "chunk": args.chunk, "device": device,
              "link_gbps": link, "threads": med["chunk"]["threads"], "repeats": args.repeats,
              "median": med, "ratios": r, "spread": spread(rounds), "targets": targets(r),
              "copy_bandwidth": measure_copy_bandwidth(device),
              "export_only": export_only(spec, args, device, args.decoder_device)}
    print(json.dumps(result) if args.json else _text(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


def _text(result: dict) -> str:
    bw = result["copy_bandwidth"]
    lines = [f"{result['model']} prompt={result['prompt']} chunk={result['chunk']} "
             f"device={result['device']} link_gbps={result['link_gbps']} "
             f"threads={result['threads']} (median of {result['repeats']})",
             table(result["median"])]
    lines += [f"{key:>28}: {value:.4f}" for key, value in result["ratios"].items()]
    lines += [f"{key:>28}: {lo:.4f} .. {hi:.4f} (min .. max over rounds)"
              for key, (lo, hi) in result["spread"].items()]
    lines += [f"  [{'ok' if ok else 'MISS'}] {name}" for name, ok in result["targets"].items()]
    lines += [f"{key:>28}: {value:.4f}" for key, value in result["export_only"].items()]
    lines.append(f"copy bandwidth ({'pinned' if bw['pinned'] else 'pageable'}): "
                 f"d2h {bw['d2h_gbps']:.2f} GB/s, h2d {bw['h2d_gbps']:.2f} GB/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
