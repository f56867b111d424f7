"""`pdsim demo [--out DIR]`: the project's main job, end to end, with no required argument.

1. the engine (CUDA if present, else CPU) runs one prompt in every mode at two chunk sizes,
   checked live by pdref, with KV and first-token parity against whole mode;
2. `pdsim calibrate` fits a profile of this device from those traces;
3. the simulator predicts the same runs: measured vs predicted, side by side;
4. a chunk-size sweep in the simulator for this device and for qwen3-0.6b on a100-pcie and h200;
5. the hybrid question (`pdsim study-hybrid`): qwen3-0.6b beside Qwen3.5 and Gemma 3 (and
   their all-full twins) at 2k..32k tokens on a100-pcie and h200: handoff bytes and
   overlap's gain, one request at a time;
6. a served run: `pdgpu serve` (a decoder and two producer processes) on one prompts file in
   whole and chunk mode, spans verified, the decoder's tokens checked against `pdgpu generate`;
7. every trace (engine, served and simulated) is checked by `pdref check`;
8. everything lands in one folder with a report.md linking the PNGs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import attrs
from tqdm import tqdm

from pdref.check import check_file
from pdref.models import context_error, list_models, load_model
from pdsim.core.engines import DEFAULT_ENGINE
from pdsim.core.profiles import load_hw
from pdsim.demo_http import run_http
from pdsim.demo_serve import ServeDemo, run_served, served_rows
from pdsim.fit.calibrate import calibrate, figures, profile_toml
from pdsim.fit.engine_runs import EnginePoint, Measured, run_point
from pdsim.fit.predict import predict, simulate_point
from pdsim.options import UsageError
from pdsim.study import answer_rows
from pdsim.study_hybrid import MODELS, PROMPTS, HybridGrid, run_study, write_outputs
from pdsim.sweep import Point, best_chunks, run_sweep
from pdsim.views.demo_report import comparison_table, report_md, trace_table
from pdsim.views.hybrid_report import bytes_words, gain_words, png_name
from pdsim.views.report import edge_note, write_atomic, write_json, write_trace
from pdsim.views.study_report import headline

SWEEP_CHUNKS = (64, 128, 256, 512, 1024, 2048)
REFERENCE = (("qwen3-0.6b", "a100-pcie"), ("qwen3-0.6b", "h200"))
REFERENCE_PROMPT = 8192
# The source design's question under each engine (`pdsim study`'s headline, smaller)
ANSWER = dict(models=("qwen3-0.6b", "llama-3.1-8b"), hws=("a100-pcie", "h200"),
              engines=("production", "seed-eager"), prompt=4096, concurrencies=(1, 8),
              requests=8, output_tokens=16, chunk=256)

# The hybrid question (`pdsim study-hybrid`'s grid, one request at a time)
HYBRID = HybridGrid(models=MODELS, hws=("a100-pcie", "h200"), engines=(DEFAULT_ENGINE,),
                    prompts=PROMPTS, concurrencies=(1,), requests=2, output_tokens=64,
                    chunk=256)


@attrs.frozen
class DemoConfig:
    """What the demo runs (defaults keep it under 3 minutes on a 2-core CPU)."""

    out: Path
    model: str = "small"
    prompt: int = 1024
    chunks: tuple[int, ...] = (128, 256, 512)
    requests: int = 3
    device: str | None = None
    progress: bool = True
    http: bool = True  # also a few served prompts streamed through `pdgpu serve --http`


ANSWER_KEYS = ("model", "hw", "engine", "concurrency", "mode", "tokens_per_s", "gain_pct",
               "prefill_s", "tail_mean_s", "ttft_p50_s")

HYBRID_KEYS = ("model", "hw", "prompt", "mode", "bytes_per_request", "twin_bytes_ratio",
               "prefill_s", "tail_mean_s", "tokens_per_s", "gain_pct")


def say(text: str) -> None:
    print(f"== {text}", flush=True)


def engine_step(cfg: DemoConfig) -> list[tuple[EnginePoint, Measured]]:
    """Every mode at every chunk size on the engine; traces under out/engine/."""
    points = [EnginePoint(cfg.prompt, c) for c in cfg.chunks]
    done = []
    bar = tqdm(points, desc="engine", unit="run", disable=not cfg.progress, file=sys.stderr)
    for point in bar:
        bar.set_postfix_str(f"chunk {point.chunk}")
        trace_dir = cfg.out / "engine" / f"chunk{point.chunk}"
        done += [(point, m) for m in run_point(point, cfg.model, trace_dir, cfg.requests,
                                               cfg.device)]
    return done


def calibrate_step(cfg: DemoConfig, runs) -> Path:
    cal = calibrate([m.trace for _, m in runs])
    path = cfg.out / "profile.toml"
    write_atomic(path, profile_toml(cal, load_hw("a100-pcie"), f"{cfg.model}-this-device"))
    for name, value, unit, rms in figures(cal):
        print(f"  {name:18} {value:12.5g} {unit:8} rms residual {rms:.2e} s")
    return path


def predict_step(cfg: DemoConfig, runs, profile: Path) -> list[tuple[Measured, dict]]:
    """Simulate each engine run with the calibrated profile; write the simulated traces."""
    spec = load_model(cfg.model)
    pairs = []
    for point, m in runs:
        pairs.append((m, predict(spec, str(profile), point, m.mode)))
        result = simulate_point(spec, str(profile), point, m.mode)
        write_trace(str(cfg.out / "sim" / f"chunk{point.chunk}-{m.mode}.jsonl"), result)
    return pairs


def sweep_step(cfg: DemoConfig, profile: Path) -> list[dict]:
    """Chunk sweeps: this device (calibrated) and the reference GPUs; one PNG each."""
    from pdsim.views.plots import plotted_rows, sweep_png

    cases = [(cfg.model, str(profile), cfg.prompt, "this-device", "this device (calibrated)")]
    cases += [(m, hw, REFERENCE_PROMPT, f"{m}-{hw}", f"{hw} under {DEFAULT_ENGINE}")
              for m, hw in REFERENCE]
    out = []
    for model, hw, prompt, label, hw_name in cases:
        base = base_sim_config(model, hw)
        chunks = tuple(c for c in SWEEP_CHUNKS if c <= prompt)
        points = [Point(mode, prompt, c, 2, 1.0) for mode in ("whole", "chunk", "layer")
                  for c in chunks]
        rows = run_sweep(base, points, jobs=2, progress=cfg.progress)
        png = f"sweep-{label}.png"
        png_bytes = sweep_png(rows, best_chunks(plotted_rows(rows)), title=f"{model} on {hw_name}",
                              fixed=True)
        write_atomic(cfg.out / png, png_bytes)
        best = best_chunks(rows)[prompt]
        print(f"  {model} on {hw_name}, prompt {prompt}: best: mode {best['mode']}, chunk "
              f"{best['chunk']}{edge_note(best['chunk'], chunks, fixed=True)}: handoff "
              f"{best['handoff_s'] * 1e3:.1f} ms, tail {best['tail_s'] * 1e3:.2f} ms -> {png}")
        out.append({"label": label, "model": model, "hw": hw_name, "prompt": prompt,
                    "png": png, "rows": rows, "best": best})
    return out


def base_sim_config(model: str, hw: str, engine: str | None = None):
    from pdsim.core.config import SimConfig
    from pdsim.core.costs import costs_for, engine_of, sim_geometry
    from pdsim.core.profiles import link_of

    spec, profile = load_model(model), load_hw(hw)
    used = engine_of(profile, engine)
    costs = costs_for(spec, profile, link_of(profile), used)
    return SimConfig(sim_geometry(spec), costs, "whole", 256,
                     labels=(("model", spec.name), ("hw", profile.name), ("engine", used.name)))


def hybrid_step(cfg: DemoConfig) -> dict:
    """`pdsim study-hybrid`'s grid (HYBRID) under out/hybrid: CSV, PNG, traces."""
    out = cfg.out / "hybrid"
    rows = run_study(HYBRID, out, jobs=2)
    write_outputs(rows, HYBRID, out)
    print("\n".join(bytes_words(rows) + gain_words(rows)))
    return {"rows": rows, "png": f"hybrid/{png_name(DEFAULT_ENGINE)}"}


def serve_step(cfg: DemoConfig) -> dict:
    # Prompts of 1/8 .. 3/8 of the demo's prompt: 128..384 tokens by default.
    demo = ServeDemo(model=cfg.model, device=cfg.device,
                     prompt_range=(max(1, cfg.prompt // 8), max(1, cfg.prompt * 3 // 8)),
                     chunk=min(cfg.chunks))
    served = run_served(demo, cfg.out / "serve")
    for row in served_rows(served):
        print(f"  {row['mode']:5}: {row['ok']}/{demo.requests} ok, "
              f"{row['tokens_per_s']:.1f} tokens/s, TTFT p50 {row['ttft_p50_s']:.2f} s, "
              f"ITL p50 {row['itl_p50_s'] * 1e3:.0f} ms, handoff p50 "
              f"{row['handoff_p50_s']:.2f} s, leaked pages {row['leaked_pages']}")
    p = served["parity"]
    print(f"  tokens: whole and chunk agree: {p['modes_agree']}; equal to pdgpu generate for "
          f"{', '.join(p['reference_requests'])}: {p['reference_ok']}")
    if cfg.http:
        served["http"] = http_step(demo, cfg.out / "serve", served)
    return served


def http_step(demo: ServeDemo, out: Path, served: dict) -> dict:
    """A few of the same prompts streamed through `pdgpu serve --http` (openai client)."""
    lines = [json.loads(x) for x in (out / "prompts.jsonl").read_text().splitlines()]
    http = run_http(demo, out, lines, served["runs"][-1])
    if "skipped" in http:
        print(f"  http: skipped: {http['skipped']}")
    else:
        print(f"  http: {', '.join(http['requests'])} streamed with the openai client through "
              f"pdgpu serve --http: tokens equal to the chunk run's: {http['tokens_equal']}; "
              f"leaked pages {http['summary'].get('leaked_pages')}; {http['wall_s']:.0f} s")
    return http


def check_step(cfg: DemoConfig) -> list:
    traces = sorted(cfg.out.glob("engine/*/*.jsonl")) + sorted(cfg.out.glob("sim/*.jsonl"))
    traces += sorted(cfg.out.glob("hybrid/traces/*.jsonl"))
    traces += [cfg.out / "serve" / f"{mode}.jsonl" for mode in ("whole", "chunk")]
    if cfg.http and (cfg.out / "serve" / "http.jsonl").exists():
        traces.append(cfg.out / "serve" / "http.jsonl")
    return [check_file(t) for t in traces]


def run_demo(cfg: DemoConfig) -> dict:
    """The whole demo; returns what report.md and summary.json hold."""
    start = time.perf_counter()
    (cfg.out / "sim").mkdir(parents=True, exist_ok=True)
    say(f"engine: {cfg.model}, prompt {cfg.prompt}, chunks {cfg.chunks}, every mode, "
        f"{cfg.requests} requests each, live pdref checks, parity against whole")
    runs = engine_step(cfg)
    say("calibrate: fit this device's cost model from the engine's stage events")
    profile = calibrate_step(cfg, runs)
    say("predict: the simulator replays the same runs on the calibrated profile")
    pairs = predict_step(cfg, runs, profile)
    print(comparison_table(pairs))
    say("sweep: chunk size in the simulator (this device, and qwen3-0.6b on a100-pcie, h200)")
    sweeps = sweep_step(cfg, profile)
    say("answer: whole vs chunk vs layer serving on a100-pcie and h200, production-class "
        "engine beside the seed's eager one")
    answer = answer_rows(**ANSWER)
    print("\n".join(headline(answer)))
    say("hybrid: how much smaller is the handoff of Qwen3.5 and Gemma 3 (beside qwen3-0.6b and "
        "their all-full twins), and does overlap still pay? a100-pcie and h200, 2k..32k")
    hybrid = hybrid_step(cfg)
    say(f"serve: pdgpu serve, {cfg.model}, a decoder and 2 producer processes, whole and chunk "
        "mode, spans verified, tokens checked against pdgpu generate")
    served = serve_step(cfg)
    say("pdref check: every trace")
    checks = check_step(cfg)
    print(trace_table(checks, cfg.out))
    result = {"config": {k: str(v) if isinstance(v, Path) else v
                         for k, v in attrs.asdict(cfg).items()},
              "pairs": pairs, "sweeps": sweeps, "answer": answer, "hybrid": hybrid,
              "served": served,
              "checks": checks,
              "wall_s": time.perf_counter() - start}
    write_atomic(cfg.out / "report.md", report_md(result, cfg.out))
    write_json(cfg.out / "summary.json", summary_json(result))
    return result


def summary_json(result: dict) -> dict:
    return {"wall_s": result["wall_s"], "config": result["config"],
            "runs": [{"mode": m.mode, "trace": m.trace, "parity": m.parity,
                      "measured": {"handoff_s": m.handoff_s, "tail_s": m.tail_s,
                                   "peak_staging_bytes": m.peak_staging_bytes},
                      "predicted": {k: p[k] for k in ("handoff_s", "tail_s",
                                                      "peak_staging_bytes")}}
                     for m, p in result["pairs"]],
            "best_chunk": {s["label"]: s["best"] for s in result["sweeps"]},
            "answer": [{k: r[k] for k in ANSWER_KEYS} for r in result["answer"]],
            "hybrid": [{k: r[k] for k in HYBRID_KEYS} for r in result["hybrid"]["rows"]],
            "served": {"parity": result["served"]["parity"],
                       "runs": served_rows(result["served"]),
                       "http": {k: v for k, v in result["served"].get("http", {}).items()
                                if k != "summary"}},
            "checks": [c.to_json() for c in result["checks"]]}


def add_args(p) -> None:
    p.add_argument("--out", default="demo-out", help="output folder")
    p.add_argument("--model", default="small", help="engine and simulator model preset "
                   f"({', '.join(list_models())}) or a profile .toml")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    p.add_argument("--chunks", default="128,256,512", help="engine chunk sizes, comma separated")
    p.add_argument("--requests", type=int, default=3,
                   help="requests per engine run (the first is warm-up, left out)")
    p.add_argument("--device", default=None, help="engine device (default: cuda if any)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--no-http", dest="http", action="store_false",
                   help="skip streaming three served prompts through `pdgpu serve --http` "
                        "with the openai client (one more server start: about 10 s on a quiet "
                        "2-core CPU, up to 40 s on a loaded one)")


def _config(args) -> DemoConfig:
    try:
        chunks = tuple(int(c) for c in args.chunks.split(",") if c.strip())
    except ValueError:
        chunks = ()
    if not chunks or min(chunks) < 1:
        raise UsageError(f"--chunks must be comma-separated integers >= 1, got {args.chunks!r}")
    for flag, value in (("--prompt", args.prompt), ("--requests", args.requests)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    problem = context_error(load_model(args.model), args.prompt, 1, "--prompt")  # + first token
    if problem:
        raise UsageError(problem)
    return DemoConfig(Path(args.out), args.model, args.prompt, chunks, args.requests,
                      args.device, not args.quiet, args.http)


def command(args) -> int:
    cfg = _config(args)
    result = run_demo(cfg)
    bad = [c for c in result["checks"] if not c.ok]
    parity = all(m.parity for m, _ in result["pairs"]) and result["served"]["parity"]["ok"] \
        and result["served"].get("http", {}).get("ok", True)  # skipped: nothing to compare
    say(f"done in {result['wall_s']:.0f} s: {cfg.out / 'report.md'}"
        + ("" if parity else "; PARITY FAILED") + (f"; {len(bad)} trace(s) refused" if bad
                                                   else ""))
    return 0 if parity and not bad else 1
