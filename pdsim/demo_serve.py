"""The demo's served run: `pdgpu serve` (a decoder and two producer processes over
torch.distributed) on one prompts file in whole and chunk mode, every span verified against
compute-time checksums, and the decoder's tokens checked against a single-process reference.

What a user relies on is the decoder's output, so parity here is end to end: both modes must
give the same tokens for every request, and those must equal `pdgpu generate` (no handoff)
for the requests it is asked about. pdsim never imports pdgpu: both run as subprocesses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs

from pdref.models import load_model
from pdsim.fit.engine_runs import engine_failed
from pdsim.fit.serve_runs import ServePoint, draw_prompts, serve_argv
from pdsim.views.report import write_atomic

MODES = ("whole", "chunk")


@attrs.frozen
class ServeDemo:
    """The served workload (defaults keep both runs well inside the demo's 3 minutes)."""

    model: str = "small"
    requests: int = 6
    prompt_range: tuple[int, int] = (128, 384)
    output_tokens: int = 12
    producers: int = 2
    concurrency: int = 3
    chunk: int = 128
    references: int = 2  # requests also run through `pdgpu generate`
    seed: int = 0
    device: str | None = None


def point(demo: ServeDemo, mode: str) -> ServePoint:
    return ServePoint(demo.concurrency, demo.prompt_range, demo.output_tokens, demo.producers,
                      mode, None, demo.requests, demo.chunk, demo.seed)


def write_prompts(demo: ServeDemo, path: Path) -> list[dict]:
    """Drawn prompts in the engine's prompts-file format (as `pdsim validate --serving`
    draws them); its lines."""
    lines = draw_prompts(point(demo, MODES[0]), load_model(demo.model).vocab)
    write_atomic(path, "".join(json.dumps(line) + "\n" for line in lines))
    return lines


def serve_mode_argv(demo: ServeDemo, mode: str, prompts: Path, out: Path) -> list[str]:
    argv = serve_argv(point(demo, mode), demo.model, prompts, out / f"{mode}.jsonl", demo.device)
    return argv + ["--results", str(out / f"{mode}-results.jsonl")]  # --verify: the default


def _run(argv: list[str], what: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:  # the demo reports it in one line, as an engine run's
        raise engine_failed(proc, what)
    return proc.stdout


def serve_mode(demo: ServeDemo, mode: str, prompts: Path, out: Path) -> dict:
    """One served run: its summary, and each request's result line by id."""
    argv = serve_mode_argv(demo, mode, prompts, out)
    summary = json.loads(_run(argv, f"pdgpu serve --mode {mode}"))
    results = [json.loads(x) for x in (out / f"{mode}-results.jsonl").read_text().splitlines()]
    return {"mode": mode, "summary": summary, "results": {r["req"]: r for r in results}}


def reference_output(demo: ServeDemo, line: dict) -> list[int]:
    argv = [sys.executable, "-m", "pdgpu", "generate", "--model", demo.model, "--seed",
            str(demo.seed), "--chunk", str(demo.chunk), "--output-tokens",
            str(line["output_tokens"]), "--tokens", ",".join(map(str, line["tokens"])), "--json"]
    return json.loads(_run(argv, f"pdgpu generate ({line['req']})"))["output"]


def parity(demo: ServeDemo, lines: list[dict], runs: list[dict]) -> dict:
    """Every request ok with equal tokens in every mode; the first ones equal generate."""
    outputs = {line["req"]: [run["results"][line["req"]] for run in runs] for line in lines}
    all_ok = all(r["status"] == "ok" for rs in outputs.values() for r in rs)
    modes_agree = all(len({tuple(r["output"]) for r in rs}) == 1 for rs in outputs.values())
    checked = lines[:demo.references]
    reference = all(reference_output(demo, line) == outputs[line["req"]][0]["output"]
                    for line in checked)
    return {"all_ok": all_ok, "modes_agree": modes_agree, "reference_ok": reference,
            "reference_requests": [line["req"] for line in checked],
            "ok": all_ok and modes_agree and reference}


def run_served(demo: ServeDemo, out: Path) -> dict:
    """Both modes on one prompts file under out/; the runs and their parity."""
    out.mkdir(parents=True, exist_ok=True)
    lines = write_prompts(demo, out / "prompts.jsonl")
    runs = [serve_mode(demo, mode, out / "prompts.jsonl", out) for mode in MODES]
    return {"config": attrs.asdict(demo), "runs": runs, "parity": parity(demo, lines, runs)}


SUMMARY_KEYS = ("ok", "tokens_per_s", "ttft_p50_s", "itl_p50_s", "handoff_p50_s",
                "peak_pool_pages", "leaked_pages", "wall_s")


def served_rows(served: dict) -> list[dict]:
    return [{"mode": run["mode"], **{k: run["summary"][k] for k in SUMMARY_KEYS}}
            for run in served["runs"]]
