"""Does chunk overlap pay on this machine? Whole vs chunk vs layer, and export only (no
compute) whole vs chunked, measured side by side.

    python bench/engine_overlap.py                      # CPU, `small`, paced link (~1 min)
    python bench/engine_overlap.py --json
    python bench/engine_overlap.py --model qwen3-0.6b --prompt 8192 --chunk 256 \
        --device cuda --link-gbps 0                     # GPU check (scripts/gpu_check.sh)
    python bench/engine_overlap.py --export-only --payloads 1e8,5e8,1e9 ...   # export curve
    python bench/engine_overlap.py --family qwen3_5 --repeats 3   # a hybrid of `small`'s sizes

Every configuration runs `--repeats` times, interleaved (the order rotates each round), after
a warm-up round; figures are medians and ratios are medians of ratios taken within a round,
so slow drift of a shared machine hits all configurations alike. Every configuration runs
with the same torch compute threads (resolved once: fair baseline). The export-only runs are
`pdgpu run --no-compute`: a payload written into the source cache, handed off whole or in
chunk spans and checked byte-exact at the decoder.
Ratios and targets (issue 11):
  export chunked / export whole      <= 1.05  (the copier pipelines spans: no per-span loss)
  chunk tail / one span's copy       <= 1.2   (the unhidden tail is about one span)
  live checks / run time             <= 1%     (wall seconds in every call into pdref's
                                               fast mirror, in line: events, stages, queries,
                                               their queueing for the audit; the worst
                                               configuration's median)
  audit lag (reported)                         (the full Monitor checks every event behind
                                               the mirror, on its own thread: seconds from an
                                               event's emission to its audit, max and median,
                                               the worst configuration's median)
  same compute threads in every configuration
Reported besides: chunk and layer handoff / whole handoff, chunked prefill / one-shot (the
compute cost of chunking), staging in spans (== max_pending), the copy bandwidth.

`--family qwen3_5|gemma3` (issue 33): the compute configurations on a hybrid of the preset's
sizes with random weights (Qwen3.5: 3 gated DeltaNet layers to 1 full attention; Gemma 3: 5
sliding layers of `--window` to 1 full; the last layer full), handed off under contract v3
(compute runs only). Besides the figures above,
`state_tail_s`: from `produced` to the last state span's `land` (the states' share of the
tail; 0 without linear layers), and the layer / chunk ratios of handoff and tail: what
layer mode, which ships a linear layer's state as soon as that layer has the whole prompt,
does to the handoff compared with chunk mode, which ships every state after the last chunk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import attrs
import torch

from pdgpu.copier import measure_copy_bandwidth
from pdgpu.engine import Engine
from pdgpu.hf_config import spec_from_config
from pdgpu.model import build_model
from pdgpu.workload import EngineConfig, Request, setup_check
from pdref.models import load_model

FIGURES = ("prefill_s", "handoff_s", "tail_s", "copy_s", "peak_staging_bytes", "check_frac",
           "compute_s", "blocked_s", "host_staging_bytes", "source_alloc_bytes", "threads",
           "audit_lag_p50_s", "audit_lag_max_s", "audit_s", "wall_s", "state_tail_s")
CHECK_TARGET = 0.01  # live checks / wall (issue 24)
COMPUTE = ("whole", "chunk", "layer", "oneshot")
EXPORT = ("export_whole", "export_chunk")


def _payloads(text: str) -> list[int]:
    return [int(float(v)) for v in text.split(",")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--max-pending", type=int, default=2)
    p.add_argument("--link-gbps", type=float, default=None,
                   help="pace d2h and h2d each (GB/s); 0 = off; default 0.2 on CPU, off on CUDA")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--decoder-device", default="cpu")
    p.add_argument("--dtype", default=None, help="override the model dtype")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None,
                   help="torch compute threads for every configuration (default: the "
                        "engine's, one core left to the copy lanes)")
    p.add_argument("--export-only", action="store_true",
                   help="only the export curve: whole vs chunked at each of --payloads")
    p.add_argument("--payloads", type=_payloads, default=None,
                   help="export curve payload bytes, comma separated (e.g. 1e8,5e8,1e9)")
    p.add_argument("--family", choices=("qwen3_5", "gemma3"),
                   help="a hybrid of the preset's sizes, random weights (compute configs only)")
    p.add_argument("--window", type=int, default=512, help="gemma3's sliding window")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the JSON result to this file")
    return p.parse_args(argv)


def _threads(args, device: str) -> int:
    """One thread count for every configuration (the engine's default, resolved once)."""
    if args.threads is not None:
        return args.threads
    if torch.device(device).type == "cpu":
        return max(1, (os.cpu_count() or 2) - 1)
    return torch.get_num_threads()


def _configs(args, device: str, link, threads: int) -> dict[str, EngineConfig]:
    base = EngineConfig("whole", chunk=args.chunk, max_pending=args.max_pending, device=device,
                        decoder_device=args.decoder_device, link_gbps=link, threads=threads)
    compute = {
        "whole": base,
        "chunk": attrs.evolve(base, mode="chunk"),
        "layer": attrs.evolve(base, mode="layer"),
        "oneshot": attrs.evolve(base, chunk=args.prompt),  # whole, prefill in one chunk
    }
    if args.family:  # compute runs only (the figures of docs/hybrid-models.md)
        return compute
    return {**compute,
            "export_whole": attrs.evolve(base, no_compute=True),
            "export_chunk": attrs.evolve(base, mode="chunk", no_compute=True)}


def measure(model, configs: dict, request: Request, repeats: int) -> list[dict]:
    """`repeats` rounds of every configuration (order rotated each round), after a warm-up
    round; each round maps config name -> metrics."""
    names, rounds = list(configs), []
    for i in range(repeats + 1):
        order = names[i % len(names):] + names[:i % len(names)]
        rounds.append({name: _metrics(Engine(model, configs[name]).run([request]))
                       for name in order})
    return rounds[1:]


def _metrics(result) -> dict:
    """The run's metrics and `state_tail_s`: from `produced` to the last state span's land
    (0 when no state crossed)."""
    events = result.events
    states = {e.span for e in events if e.kind == "issue" and e.state}
    lands = [e.t for e in events if e.kind == "land" and e.span in states]
    produced = max((e.t for e in events if e.kind == "produced"), default=0.0)
    return {**result.metrics, "state_tail_s": max(lands) - produced if lands else 0.0}


def medians(rounds: list[dict]) -> dict:
    return {name: {k: statistics.median(r[name][k] or 0 for r in rounds) for k in FIGURES}
            for name in rounds[0]}


def _paired(rounds: list[dict], fn) -> float:
    """Median over rounds of a ratio taken within each round (drift cancels)."""
    return statistics.median(fn(r) for r in rounds)


def _ratio(a: str, b: str, figure: str = "handoff_s"):
    """a's figure over b's in one round (inf when b's is 0: e.g. no tail at all)."""
    return lambda r: r[a][figure] / r[b][figure] if r[b][figure] else math.inf


def spread(rounds: list[dict]) -> dict:
    """Min and max over rounds of the main ratios: how much the machine's noise moves them."""
    fns = {"chunk_tail_over_span_copy": lambda r: r["chunk"]["tail_s"] / r["chunk"]["copy_s"],
           "chunk_handoff_over_whole": _ratio("chunk", "whole"),
           "layer_handoff_over_whole": _ratio("layer", "whole"),
           "layer_handoff_over_chunk": _ratio("layer", "chunk"),
           "layer_tail_over_chunk": _ratio("layer", "chunk", "tail_s")}
    if "export_chunk" in rounds[0]:
        fns["export_chunk_over_whole"] = _ratio("export_chunk", "export_whole")
    return {k: (min(map(fn, rounds)), max(map(fn, rounds))) for k, fn in fns.items()}


def ratios(rounds: list[dict], span_bytes: int, max_pending: int) -> dict:
    med = medians(rounds)
    export = ({"export_chunk_over_whole": _paired(rounds, _ratio("export_chunk", "export_whole"))}
              if "export_chunk" in med else {})
    return {
        **export,
        "layer_handoff_over_chunk": _paired(rounds, _ratio("layer", "chunk")),
        "layer_tail_over_chunk": _paired(rounds, _ratio("layer", "chunk", "tail_s")),
        "chunk_tail_over_span_copy": _paired(rounds, lambda r: r["chunk"]["tail_s"]
                                             / r["chunk"]["copy_s"]),
        "chunk_tail_over_whole_tail": _paired(rounds, _ratio("chunk", "whole", "tail_s")),
        "chunk_handoff_over_whole": _paired(rounds, _ratio("chunk", "whole")),
        "layer_handoff_over_whole": _paired(rounds, _ratio("layer", "whole")),
        "chunked_prefill_overhead": _paired(rounds, lambda r: r["whole"]["prefill_s"]
                                            / r["oneshot"]["prefill_s"] - 1),
        "chunk_staging_spans": med["chunk"]["host_staging_bytes"] / span_bytes,
        "chunk_peak_in_flight_spans": med["chunk"]["peak_staging_bytes"] / span_bytes,
        "chunk_staging_over_whole": med["chunk"]["peak_staging_bytes"]
        / med["whole"]["peak_staging_bytes"],
        "live_check_frac": max(m["check_frac"] for m in med.values()),
        "audit_lag_p50_s": max(m["audit_lag_p50_s"] for m in med.values()),
        "audit_lag_max_s": max(m["audit_lag_max_s"] for m in med.values()),
        "audit_frac": max(m["audit_s"] / m["wall_s"] for m in med.values()),
        "threads_differ": len({r[n]["threads"] for r in rounds for n in r}) > 1,
        "max_pending": max_pending,
    }


def targets(r: dict) -> dict:
    export = ({"export chunked <= 1.05 x export whole": r["export_chunk_over_whole"] <= 1.05}
              if "export_chunk_over_whole" in r else {})
    return {
        **export,
        "chunk tail <= 1.2 x one span's copy": r["chunk_tail_over_span_copy"] <= 1.2,
        "live checks <= 1% of run time": r["live_check_frac"] <= CHECK_TARGET,
        "same compute threads in every configuration": not r["threads_differ"],
        "chunk staging == max_pending spans": r["chunk_staging_spans"] == r["max_pending"],
        "chunk in flight <= max_pending spans": r["chunk_peak_in_flight_spans"] <= r["max_pending"],
    }


def export_curve(model, args, device: str, link, threads: int) -> list[dict]:
    """Export only at each payload: whole vs chunked handoff, interleaved, median of ratios."""
    configs = {k: v for k, v in _configs(args, device, link, threads).items() if k in EXPORT}
    per_token = model.spec.geometry(16).bytes_per_token
    rows = []
    for payload in args.payloads:
        prompt = -(-payload // per_token)
        request = Request("r0", (0,) * prompt, 0)
        rounds = measure(model, configs, request, args.repeats)
        med = medians(rounds)
        rows.append({"payload": payload, "prompt": prompt,
                     "whole_s": med["export_whole"]["handoff_s"],
                     "chunk_s": med["export_chunk"]["handoff_s"],
                     "chunk_over_whole": _paired(rounds, _ratio("export_chunk", "export_whole")),
                     "whole_gbps": payload / med["export_whole"]["handoff_s"] / 1e9,
                     "chunk_gbps": payload / med["export_chunk"]["handoff_s"] / 1e9})
    return rows


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
    spec = hybrid_spec(spec, args.family, args.window) if args.family else spec
    model = build_model(spec, device=device, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (args.prompt,), generator=gen)
    return model, Request("r0", tuple(tokens.tolist()), 0), device, link or None


def hybrid_spec(spec, family: str, window: int):
    """A `family` hybrid of the preset's sizes and dtype, from a config.json as transformers
    writes it (Qwen3.5: 1 full attention layer in 4; Gemma 3: 1 in 6; the last layer full)."""
    every, local = (4, "linear_attention") if family == "qwen3_5" else (6, "sliding_attention")
    config = {
        "dtype": spec.dtype, "num_hidden_layers": spec.layers, "hidden_size": spec.hidden,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim, "intermediate_size": spec.intermediate,
        "vocab_size": spec.vocab, "rms_norm_eps": spec.rms_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "max_position_embeddings": max(spec.max_context or 0, 65536),
        "layer_types": [local if (i + 1) % every and i + 1 < spec.layers else "full_attention"
                        for i in range(spec.layers)]}
    if family == "qwen3_5":
        config.update({
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "hidden_act": "silu", "linear_num_key_heads": spec.kv_heads,
            "linear_num_value_heads": spec.heads, "linear_key_head_dim": spec.head_dim,
            "linear_value_head_dim": spec.head_dim, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta,
                                "partial_rotary_factor": 0.25}})
    else:
        config.update({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh", "sliding_window": window,
            "query_pre_attn_scalar": spec.head_dim,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    name = f"{spec.name}-as-{family}"
    return spec_from_config(config, name, name)


def run_all(args) -> dict:
    model, request, device, link = _setup(args)
    threads = _threads(args, device)
    result = {"model": model.spec.name, "family": args.family, "prompt": args.prompt,
              "chunk": args.chunk, "device": device, "link_gbps": link, "threads": threads,
              "repeats": args.repeats}
    if args.payloads:
        result["export_curve"] = export_curve(model, args, device, link, threads)
    if args.export_only:
        return result
    configs = _configs(args, device, link, threads)
    rounds = measure(model, configs, request, args.repeats)
    # one staging slot's bytes in chunk mode: its largest span (a chunk, or a hybrid's state)
    span = setup_check(model.spec, configs["chunk"], [request]).span_elems \
        * model.spec.dtype_bytes
    r = ratios(rounds, span, args.max_pending)
    result.update({"median": medians(rounds), "ratios": r, "spread": spread(rounds),
                   "targets": targets(r), "copy_bandwidth": measure_copy_bandwidth(device)})
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run_all(args)
    print(json.dumps(result) if args.json else _text(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


def _curve_text(rows: list[dict]) -> list[str]:
    lines = ["export only (no compute): payload, whole s, chunked s, chunked / whole "
             "(median of ratios), GB/s whole, chunked"]
    lines += [f"  {r['payload']:>12,d} B  {r['whole_s']:.4f}  {r['chunk_s']:.4f}  "
              f"{r['chunk_over_whole']:.3f}  {r['whole_gbps']:.2f}  {r['chunk_gbps']:.2f}"
              for r in rows]
    return lines


def _check_lines(r: dict) -> list[str]:
    """The live checks' share with its target, and the audit behind them."""
    return [f"live checks / wall: {r['live_check_frac']:.3%} (target <= {CHECK_TARGET:.0%}; "
            "worst configuration)",
            f"audit behind the mirror: lag p50 {r['audit_lag_p50_s'] * 1e3:.3f} ms, max "
            f"{r['audit_lag_max_s'] * 1e3:.3f} ms; audit thread busy {r['audit_frac']:.3%} "
            "of wall (worst configurations)"]


def _text(result: dict) -> str:
    lines = [f"{result['model']} prompt={result['prompt']} chunk={result['chunk']} "
             f"device={result['device']} link_gbps={result['link_gbps']} "
             f"threads={result['threads']} (median of {result['repeats']})"]
    if "median" in result:
        bw = result["copy_bandwidth"]
        lines.append(table(result["median"]))
        lines += [f"{key:>28}: {float(value):.4f}" for key, value in result["ratios"].items()]
        lines += [f"{key:>28}: {lo:.4f} .. {hi:.4f} (min .. max over rounds)"
                  for key, (lo, hi) in result["spread"].items()]
        lines += [f"  [{'ok' if ok else 'MISS'}] {name}"
                  for name, ok in result["targets"].items()]
        lines += _check_lines(result["ratios"])
        lines.append(f"copy bandwidth ({'pinned' if bw['pinned'] else 'pageable'}): "
                     f"d2h {bw['d2h_gbps']:.2f} GB/s, h2d {bw['h2d_gbps']:.2f} GB/s")
    if "export_curve" in result:
        lines += _curve_text(result["export_curve"])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
