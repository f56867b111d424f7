"""Text of `pdsim demo`: the measured-vs-predicted table, the trace checks, report.md."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from pdref.cli_format import count
from pdsim.views.hybrid_report import bytes_table, bytes_words, overlap_table
from pdsim.views.report import edge_note
from pdsim.views.study_report import engine_words, headline

DEFINITIONS = [
    "- **handoff**: from the request's start (its slab reserved, prefill begins) until it "
    "could be admitted at the decoder: the last span landed, or prefill produced if later. "
    "This is what a disaggregated server waits before decoding.",
    "- **tail**: handoff minus prefill, the part of the copy left over after the last prefill "
    "chunk, i.e. not hidden behind compute. Chunk and layer modes exist to shrink it.",
    "- **staging**: the most bytes of copy spans in flight at once (the staging buffers the "
    "scheme needs).",
]


def _err(pred: float, meas: float) -> str:
    return f"{100.0 * (pred / meas - 1.0):+.1f}%" if meas > 0 else "-"


def comparison_rows(pairs) -> list[list[str]]:
    """One row per engine run: measured and predicted handoff, tail, staging."""
    rows = [["chunk", "mode", "handoff ms", "predicted", "err", "tail ms", "predicted",
             "staging MiB", "predicted", "parity"]]
    for m, p in pairs:
        rows.append([str(p["chunk"]), m.mode, f"{m.handoff_s * 1e3:.1f}",
                     f"{p['handoff_s'] * 1e3:.1f}", _err(p["handoff_s"], m.handoff_s),
                     f"{m.tail_s * 1e3:.2f}", f"{p['tail_s'] * 1e3:.2f}",
                     f"{m.peak_staging_bytes / 2**20:.2f}",
                     f"{p['peak_staging_bytes'] / 2**20:.2f}", "ok" if m.parity else "FAILED"])
    return rows


def _text(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def comparison_table(pairs) -> str:
    return _text(comparison_rows(pairs))


def _rel(path: str, out: Path) -> str:
    return os.path.relpath(path, out)


def check_rows(checks, out: Path) -> list[list[str]]:
    rows = [["trace", "verdict"]]
    for c in checks:
        verdict = (f"ok: {count(c.events, 'event')}, {count(c.requests, 'request')}" if c.ok
                   else f"line {c.line}: {c.code} {c.message}")
        rows.append([_rel(c.file, out), verdict])
    return rows


def trace_table(checks, out: Path) -> str:
    return "\n".join(f"  {t}: {v}" for t, v in check_rows(checks, out)[1:])


def sweep_lines(sweeps) -> list[str]:
    lines = []
    for s in sweeps:
        b = s["best"]
        edge = edge_note(b["chunk"], {r["chunk"] for r in s["rows"] if r["prompt"] == s["prompt"]},
                         fixed=True)  # the demo's own range: no advice to widen it
        lines += [f"### {s['model']} on {s['hw']}, prompt {s['prompt']}", "",
                  f"Best: mode {b['mode']}, chunk {b['chunk']}{edge}: handoff "
                  f"{b['handoff_s'] * 1e3:.1f} ms, tail {b['tail_s'] * 1e3:.2f} ms, "
                  f"staging {b['peak_staging_bytes'] / 2**20:.1f} MiB.", "",
                  f"![{s['label']}]({s['png']})", ""]
    return lines


def answer_lines(rows) -> list[str]:
    """The source design's question (whole vs chunk vs layer, serving tokens/s) under the
    production-class engine beside the seed's eager one (`pdsim study`'s headline)."""
    if not rows:
        return []
    r = rows[0]
    return ["## Does overlap pay? Under each engine (simulator)", "",
            f"Closed loop, prompt {r['prompt']} tokens, chunk 256, one producer and one "
            "decoder (`pdsim study`'s base point; `pdsim study` varies each axis): whole "
            "copy's tokens/s and chunk's and layer's change over it. `production` prices each "
            "op on a roofline from published kernel figures (docs/sim-validation.md), "
            "`seed-eager` is the source design's eager engine.", "", *headline(rows), "",
            *engine_words(rows), ""]


def hybrid_lines(hybrid: dict | None) -> list[str]:
    """The hybrid question (`pdsim study-hybrid`'s grid, one request at a time)."""
    if not hybrid:
        return []
    rows = hybrid["rows"]
    return ["## Hybrid models: how much smaller is the handoff, does overlap still pay? "
            "(simulator)", "",
            "One request at a time (closed loop, C=1), chunk 256, production-class engine; "
            "each hybrid beside its all-full twin (NAME+full: every layer full attention) and "
            "the dense qwen3-0.6b. MiB handed off per request (÷N: N times less than the "
            "twin):", "", *bytes_table(rows), "", *bytes_words(rows), "",
            "Tokens/s of chunk and layer mode over whole copy, over 2,048..32,768 tokens:", "",
            *overlap_table(rows), "",
            f"![hybrid models]({hybrid['png']})", "",
            "Rows: `hybrid/hybrid.csv`; traces of each hybrid at 32,768 tokens: "
            "`hybrid/traces/` (checked below). `pdsim study-hybrid` runs the grid at C=8 "
            "too, with its tables and findings.", ""]


def engine_devices(pairs) -> str:
    """The devices the engine really ran on, from its traces' headers: "cpu", "cuda:0 -> cpu"."""
    seen = []
    for m, _ in pairs:
        with open(m.trace, encoding="utf-8") as f:
            header = json.loads(f.readline())
        producer, decoder = header.get("device", "unknown"), header.get("decoder_device")
        name = producer if decoder in (None, producer) else f"{producer} -> decoder {decoder}"
        if name not in seen:
            seen.append(name)
    return ", ".join(seen) or "unknown"


def prefill_share(pairs) -> float:
    """Median of prefill / handoff over the engine runs (0..1)."""
    return statistics.median(m.prefill_s / m.handoff_s for m, _ in pairs if m.handoff_s > 0)


def why_prefill_dominates(pairs, devices: str) -> str:
    share = prefill_share(pairs)
    text = (f"On this run prefill is {100 * share:.0f}% of handoff (median over the runs), so "
            "the modes differ only in the small tail. ")
    if "cuda" in devices:
        return text
    return text + ("That is expected on a CPU: the prefill's matrix products run at CPU "
                   "speed, tens to hundreds of times slower than on a GPU, while the copy is a "
                   "memory-to-memory transfer in the same RAM at several GB/s; the copy hides "
                   "easily behind compute. On a GPU prefill is fast and the copy crosses a "
                   "PCIe or network link, so the tail is a large part of handoff (see the "
                   "a100-pcie and h200 sweeps below).")


def in_sample_note(pairs) -> str:
    """What an in-sample error is, with this run's range: not a forecast's miss (the profile
    was fitted from these runs) but how far one run is from the fitted per-stage averages."""
    errs = [100.0 * (p["handoff_s"] / m.handoff_s - 1.0) for m, p in pairs if m.handoff_s > 0]
    spread = f"here {min(errs):+.0f}% .. {max(errs):+.0f}%" if errs else "none here"
    return ("These predictions are in-sample: the profile was fitted from these very runs, so "
            f"an error (err: predicted / measured - 1; {spread}) is not a forecast's miss. "
            "The fit gives each stage one cost (per token, per byte, per span), by least "
            "squares over every mode and chunk size at once; a run whose stages ran faster or "
            "slower than that average shows the difference. On a CPU most of it is prefill "
            "competing with the copier and other processes for the same cores, which differs "
            "by mode (whole copies after compute, chunk and layer during it) and from run to "
            "run; one contention term cannot match each run. `pdsim validate` measures the "
            "error on held-out runs, the figure that says how well the simulator predicts.")


def report_md(result: dict, out: Path) -> str:
    cfg = result["config"]
    ok = all(c.ok for c in result["checks"])
    parity = all(m.parity for m, _ in result["pairs"])
    devices = engine_devices(result["pairs"])
    asked = f"asked for {cfg['device']}" if cfg["device"] else "no --device: cuda if present"
    lines = [
        "# pdhandoff demo", "",
        f"Engine: model `{cfg['model']}`, prompt {cfg['prompt']} tokens, chunks "
        f"{', '.join(map(str, cfg['chunks']))} tokens, ran on **{devices}** "
        f"({asked}), "
        f"{count(cfg['requests'], 'request')} per run (timings: median over all but the first, "
        "the engine's warm-up). "
        f"Wall time {result['wall_s']:.0f} s.", "",
        "## What the figures mean", "", *DEFINITIONS, "",
        why_prefill_dominates(result["pairs"], devices), "",
        "## Engine vs simulator (calibrated from these traces: `profile.toml`)", "",
        f"KV and first-token parity against whole mode: {'ok' if parity else 'FAILED'}. "
        + in_sample_note(result["pairs"]), "",
        _markdown(comparison_rows(result["pairs"])), "",
        "## Chunk-size sweeps (simulator)", "", *sweep_lines(result["sweeps"]),
        *answer_lines(result.get("answer")),
        *hybrid_lines(result.get("hybrid")),
        *served_lines(result["served"]),
        f"## Trace checks (`pdref check`): {'all legal' if ok else 'VIOLATIONS'}", "",
        _markdown(check_rows(result["checks"], out)), "",
        "Engine traces: `engine/`, served runs: `serve/`, simulated traces: `sim/`, figures: "
        "`summary.json`.", ""]
    return "\n".join(lines)


def served_lines(served: dict) -> list[str]:
    """The served run: a decoder and producer processes, tokens checked end to end."""
    cfg, p = served["config"], served["parity"]
    rows = [["mode", "ok", "tokens/s", "TTFT p50 s", "ITL p50 ms", "handoff p50 s",
             "peak pool pages", "leaked pages", "wall s"]]
    for run in served["runs"]:
        s = run["summary"]
        rows.append([run["mode"], f"{s['ok']}/{s['requests']}", f"{s['tokens_per_s']:.1f}",
                     f"{s['ttft_p50_s']:.2f}", f"{s['itl_p50_s'] * 1e3:.0f}",
                     f"{s['handoff_p50_s']:.2f}", str(s["peak_pool_pages"]),
                     str(s["leaked_pages"]), f"{s['wall_s']:.1f}"])
    verdict = "ok" if p["ok"] else "FAILED"
    return ["## Served run (`pdgpu serve`)", "",
            f"A decoder and {cfg['producers']} producer processes over torch.distributed "
            "(control over gloo, KV through shared memory; NCCL between GPUs), model "
            f"`{cfg['model']}`, {count(cfg['requests'], 'request')} of "
            f"{cfg['prompt_range'][0]}..{cfg['prompt_range'][1]} prompt tokens and "
            f"{cfg['output_tokens']} output tokens, concurrency {cfg['concurrency']}, chunk "
            f"{cfg['chunk']}; every landed span checked against a checksum taken when its KV "
            "was computed (`--verify`, on by default). The tokens are the decoder's, decoded "
            f"from the KV it received. Parity: {verdict} (every request ok: {p['all_ok']}; "
            f"whole and chunk give the same tokens: {p['modes_agree']}; equal to `pdgpu "
            f"generate`, no handoff, for {', '.join(p['reference_requests'])}: "
            f"{p['reference_ok']}). Timings on a shared CPU are noisy: these are one run "
            "each, not a mode comparison (`bench/serve.py` is).", "", _markdown(rows), "",
            *http_lines(served.get("http"))]


def http_lines(http: dict | None) -> list[str]:
    """`pdsim demo --http`: the same prompts streamed through `pdgpu serve --http`."""
    if not http:
        return []
    if "skipped" in http:
        return [f"Through HTTP (`--http`): skipped, {http['skipped']}.", ""]
    return [f"Through HTTP (`pdgpu serve --http`, the openai client, streamed): "
            f"{', '.join(http['requests'])}; tokens equal to the chunk run's: "
            f"{http['tokens_equal']}; leaked pages {http['summary'].get('leaked_pages')}; "
            f"trace `serve/http.jsonl`.", ""]
