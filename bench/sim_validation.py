"""pdsim's engine profiles against published measurements that none of them was fitted to.

    python bench/sim_validation.py                      # the production profile
    python bench/sim_validation.py --engine seed-eager  # the same figures, another engine

Prints one markdown table row per figure: what was measured, where (source), the measured
value, pdsim's prediction and the error (docs/sim-validation.md holds a dated copy).
Measured figures are typed in below from their sources, each cited where it is used:
  ISSUE37  this project's issue 37, table "Put side by side": an independent simulator built
           on kernel times measured on one A100 (Llama-3-8B, tensor parallel 1).
  LAMBDA   LambdaLabsML/vllm-benchmark (github.com/LambdaLabsML/vllm-benchmark), result files
           results/prompt_{10,80}/1x{A100,H100}-80GB-SXM/<model>_tp1_len{2000,2048}.json:
           vLLM 0.6 (September 2024) serving N ShareGPT prompts sent at once, bf16, one GPU.
           Their runs stream tokens ten decode steps at a time (each request's inter-token
           gaps come in bursts of 10 tokens), so one decode step is the ITL / 10.
"""

from __future__ import annotations

import argparse
import statistics

import attrs

from pdref.models import load_model
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import costs_for, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.profiles import link_of, load_hw
from pdsim.core.serving import serving_config, simulate_serving
from pdsim.core.workload import WorkloadSpec, build_requests

LLAMA, NEMO = "llama-3.1-8b", "mistral-nemo-12b"  # Llama-3-8B's geometry is Llama-3.1-8B's

# ISSUE37: prefill of one prompt (ms) and a decode step over a 2k context (ms).
ISSUE37_PREFILL = ((512, 38.5), (2048, 176.5), (8192, 618.5))
ISSUE37_DECODE = ((1, 10.5), (16, 12.7))
# ISSUE37: TTFT p50 (s) at 0.4 requests/s, prompts uniform in 512..4096, 128 tokens out.
ISSUE37_TTFT_P50_S = 0.21

# LAMBDA runs: ShareGPT prompt and output lengths (tokens, in the order sent), and what the
# run measured: duration (s), median TTFT (ms), median TPOT (ms), mean and median ITL (ms).
SHAREGPT_80_IN = (13, 25, 27, 10, 329, 29, 399, 328, 4, 205, 16, 372, 403, 9, 12, 770, 227, 8,
                  14, 390, 659, 59, 76, 744, 619, 279, 344, 9, 10, 45, 11, 4, 80, 768, 317, 40,
                  619, 8, 298, 16, 17, 696, 575, 11, 7, 281, 12, 147, 481, 770, 336, 6, 331, 9,
                  45, 222, 802, 481, 93, 641, 22, 15, 16, 77, 32, 689, 178, 9, 628, 480, 42,
                  336, 24, 515, 761, 112, 113, 348, 82, 467)
RUNS = {
    # (model, hw, prompts): inputs, outputs, duration s, median TTFT ms (requests that made
    # a token), median TPOT ms, mean ITL ms, median ITL ms
    (LLAMA, "a100-sxm", 10): (
        (13, 25, 27, 10, 329, 29, 399, 328, 4, 205),
        (120, 507, 233, 194, 101, 741, 9, 3, 6, 31), 8.585, 126.73, 12.01, 114.99, 114.85),
    (LLAMA, "h100-sxm", 10): (
        (13, 25, 27, 10, 329, 29, 399, 328, 4, 205),
        (120, 429, 233, 194, 101, 741, 9, 3, 6, 31), 5.367, 62.19, 7.56, 72.40, 72.30),
    (NEMO, "a100-sxm", 10): (
        (13, 27, 28, 12, 336, 29, 405, 331, 4, 206),
        (124, 494, 241, 103, 0, 770, 0, 0, 7, 28), 12.964, 183.68, 17.60, 166.04, 166.41),
    (NEMO, "h100-sxm", 10): (
        (13, 27, 28, 12, 336, 29, 405, 331, 4, 206),
        (124, 816, 241, 95, 0, 770, 0, 0, 7, 28), 8.420, 82.56, 10.80, 101.72, 101.63),
    (LLAMA, "a100-sxm", 80): (
        SHAREGPT_80_IN,
        (120, 495, 233, 194, 101, 741, 9, 3, 6, 31, 392, 84, 396, 45, 291, 9, 173, 277, 334, 37,
         587, 361, 36, 135, 26, 45, 450, 118, 226, 4, 5, 146, 59, 11, 567, 192, 478, 130, 13,
         223, 188, 16, 35, 276, 202, 492, 239, 129, 26, 79, 17, 204, 11, 207, 78, 340, 17, 9,
         123, 6, 559, 5, 316, 26, 417, 206, 151, 42, 25, 18, 159, 0, 25, 267, 19, 12, 768, 67,
         628, 11), 11.859, 1206.26, 20.20, 176.43, 137.85),
    (LLAMA, "h100-sxm", 80): (
        SHAREGPT_80_IN,
        (120, 447, 233, 194, 101, 741, 9, 3, 6, 31, 392, 84, 396, 45, 291, 9, 173, 277, 334, 37,
         587, 345, 36, 135, 26, 45, 450, 118, 226, 4, 5, 146, 59, 11, 567, 192, 478, 130, 13,
         223, 188, 16, 35, 276, 202, 492, 239, 129, 26, 79, 17, 204, 11, 207, 78, 340, 17, 9,
         123, 6, 559, 5, 316, 26, 417, 206, 151, 42, 25, 18, 159, 0, 25, 267, 19, 12, 768, 67,
         628, 11), 6.737, 522.34, 9.94, 91.42, 81.77),
}
STEPS_PER_BURST = 10  # LAMBDA's runs stream ten decode steps at a time


def costs(model: str, hw: str, engine: str):
    device = load_hw(hw)
    return costs_for(load_model(model), device, link_of(device), load_engine(engine))


def step_s(c, batch: int, kv_tokens: int) -> float:
    return c.decode_base_s(batch) + kv_tokens * c.decode_kv_token_s


def op_rows(engine: str) -> list[tuple]:
    """(figure, source, measured s, predicted s) of single ops."""
    c = costs(LLAMA, "a100-pcie", engine)
    rows = [(f"prefill {n} tokens, llama-3-8b, A100", "ISSUE37", ms / 1e3,
             c.compute_s((0, n))) for n, ms in ISSUE37_PREFILL]
    rows += [(f"decode step batch {b}, 2k context, llama-3-8b, A100", "ISSUE37", ms / 1e3,
              step_s(c, b, b * 2048)) for b, ms in ISSUE37_DECODE]
    for (model, hw, n), run in RUNS.items():
        inputs, outputs, *_, mean_itl, median_itl = run
        steps = run_steps(costs(model, hw, engine), inputs, outputs)
        peak = sum(o > 1 for o in outputs)
        what = "mean" if n == 10 else "median"
        measured = (mean_itl if n == 10 else median_itl) / 1e3 / STEPS_PER_BURST
        predicted = statistics.fmean(steps) if n == 10 else statistics.median(steps)
        rows.append((f"decode step ({what} over the run, batch {peak}..1), {model}, {hw}",
                     f"LAMBDA {n} prompts", measured, predicted))
    return rows


def run_steps(c, inputs, outputs) -> list[float]:
    """Predicted time of each decode step of a batch that starts with every request and
    loses each at its output count (a request's first token is its prefill's)."""
    out = []
    for s in range(1, max(outputs)):
        live = [(i, o) for i, o in zip(inputs, outputs, strict=True) if o > s]
        out.append(step_s(c, len(live), sum(i + s for i, _ in live)))
    return out


def serving_rows(engine: str) -> list[tuple]:
    """(figure, source, measured, predicted) of whole serving runs replayed in pdsim."""
    rows = [("TTFT p50 (s), llama-3-8b, A100, 0.4 req/s, prompts 512..4096, 128 out",
             "ISSUE37", ISSUE37_TTFT_P50_S, poisson_ttft(engine))]
    for (model, hw, n), (inputs, outputs, duration, ttft, tpot, *_) in RUNS.items():
        summary = replay(model, hw, engine, inputs, outputs)
        where = f"{model}, {hw}, {n} prompts"
        rows += [(f"output tokens/s, {where}", f"LAMBDA {n} prompts",
                  sum(outputs) / duration, summary["generated_tokens"] / summary["wall_s"]),
                 (f"TTFT p50 (s), {where}", f"LAMBDA {n} prompts", ttft / 1e3,
                  summary["ttft_p50_s"]),
                 (f"TPOT p50 (s), {where}", f"LAMBDA {n} prompts", tpot / 1e3,
                  summary["itl_p50_s"])]
    return rows


def poisson_ttft(engine: str) -> float:
    """ISSUE37's serving point in pdsim: 500 Poisson arrivals (seed 0) on a100-pcie."""
    spec = load_model(LLAMA)
    spec_work = WorkloadSpec(requests=500, prompt_range=(512, 4096), rate=0.4, seed=0)
    work = build_requests(spec_work, 16)
    work = [attrs.evolve(r, output_tokens=128) for r in work]
    geometry = sim_geometry(spec)
    cfg = SimConfig(geometry, costs(LLAMA, "a100-pcie", engine), "chunk", 512, stages=False)
    return simulate_serving(serving_config(cfg, work), work)["ttft_p50_s"]


def replay(model: str, hw: str, engine: str, inputs, outputs) -> dict:
    """The run in pdsim: every request at t = 0 (one producer, one decoder, room in the
    decoder's pool for all), requests that made no token left out."""
    spec = load_model(model)
    work = [RequestSpec(f"r{k}", 0.0, i, 0, o) for k, (i, o) in
            enumerate(zip(inputs, outputs, strict=True)) if o > 0]
    geometry = sim_geometry(spec)
    cfg = SimConfig(geometry, costs(model, hw, engine), "chunk", 512, stages=False)
    pool = sum(geometry.pages_for(r.prompt + r.output_tokens) for r in work)
    return simulate_serving(serving_config(cfg, work, pool_pages=pool), work)


def error_pct(measured: float, predicted: float) -> float:
    return 100.0 * (predicted / measured - 1.0)


def markdown(rows: list[tuple], unit: str) -> str:
    lines = [f"| figure | source | measured {unit} | pdsim {unit} | error |",
             "|---|---|---|---|---|"]
    scale = 1e3 if unit == "ms" else 1.0
    for figure, source, measured, predicted in rows:
        lines.append(f"| {figure} | {source} | {measured * scale:.4g} | "
                     f"{predicted * scale:.4g} | {error_pct(measured, predicted):+.0f}% |")
    return "\n".join(lines)


def summary_line(rows: list[tuple], goal: float) -> str:
    errors = [abs(error_pct(m, p)) for _, _, m, p in rows]
    within = sum(e <= goal for e in errors)
    return (f"{within} of {len(errors)} within {goal:.0f}%; median |error| "
            f"{statistics.median(errors):.0f}%, worst {max(errors):.0f}%")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", default="production", help="engine profile")
    args = p.parse_args(argv)
    ops, runs = op_rows(args.engine), serving_rows(args.engine)
    print(f"engine {args.engine}\n\nper op (goal 15%): {summary_line(ops, 15)}\n")
    print(markdown(ops, "ms"))
    print(f"\nserving runs (goal 25%): {summary_line(runs, 25)}\n")
    print(markdown(runs, ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
