"""Soak of `pdgpu serve` under every fault at once (issue 10).

One `pdgpu serve` process (a decoder and 2-3 producers) serves REQUESTS requests on `tiny`
with failed, stalled, corrupted and cancelled spans and requests, and producers SIGKILLed
every --kill-every seconds (round robin) and restarted. Then:
- 0 leaked pages (the summary's `leaked_pages`: the pool wholly free at the end),
- 0 illegal traces (`pdref check` on the whole trace),
- 0 wrong tokens among `ok` requests: each is compared with `pdgpu generate`'s reference
  for its prompt; the workload reuses --distinct prompts, so the references are computed
  once per distinct prompt (request i serves prompt i mod distinct, under its own id),
- 0 hangs: the command must end within --timeout seconds (else it is killed: a hang),
- resident memory of the decoder process sampled every second: growth from the end of
  warm-up (the first --warmup fraction of the wall time) to the end under 10%,
- no process left in its session,
and the rate of requests served. Prints one JSON object (and a table); exit 1 when a target
is missed.

    python bench/soak.py                       # the full soak: 10,000 requests
    python bench/soak.py --requests 2000       # shorter
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdgpu.generate import generate  # noqa: E402
from pdgpu.serve.models import load_served_model  # noqa: E402
from pdref.check import check_file  # noqa: E402

MODEL = "tiny"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--producers", type=int, default=3)
    p.add_argument("--distinct", type=int, default=64, help="distinct prompts, reused")
    p.add_argument("--prompt-range", default="24:96")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--fail-rate", type=float, default=0.02)
    p.add_argument("--stall-rate", type=float, default=0.01)
    p.add_argument("--span-timeout", type=float, default=1.0)
    p.add_argument("--corrupt-rate", type=float, default=0.02)
    p.add_argument("--cancel-rate", type=float, default=0.05)
    p.add_argument("--kill-every", type=float, default=20.0,
                   help="seconds between producer kills (round robin over producers)")
    p.add_argument("--kills", type=int, default=12, help="kills scheduled (those after the "
                   "run ended do not happen; the summary counts those that did)")
    p.add_argument("--timeout", type=float, default=1800.0, help="a run longer is a hang")
    p.add_argument("--warmup", type=float, default=0.2, help="warm-up fraction of the wall")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="keep trace, results and report here (default: temp dir)")
    return p.parse_args(argv)


def _prompts(args) -> tuple[list[list[int]], list[dict]]:
    import random
    rng = random.Random(args.seed)
    low, high = (int(x) for x in args.prompt_range.split(":"))
    distinct = [[rng.randrange(256) for _ in range(rng.randint(low, high))]
                for _ in range(args.distinct)]
    lines = [{"req": f"s{i}", "tokens": distinct[i % args.distinct],
              "output_tokens": args.output_tokens} for i in range(args.requests)]
    return distinct, lines


def _references(args, distinct) -> dict[tuple[int, ...], list[int]]:
    """`pdgpu generate`'s tokens for each distinct prompt (one thread, as the ranks)."""
    import torch
    torch.set_num_threads(1)
    model = load_served_model(MODEL, args.seed, None)
    return {tuple(p): generate(model, p, args.output_tokens, args.chunk, 0) for p in distinct}


def _command(args, folder: Path) -> list[str]:
    kills = [f"{k % args.producers}@{args.kill_every * (k + 1):g}" for k in range(args.kills)]
    return [sys.executable, "-m", "pdgpu", "serve", "--model", MODEL, "--seed", str(args.seed),
            "--prompts", str(folder / "prompts.jsonl"), "--producers", str(args.producers),
            "--concurrency", str(args.concurrency), "--chunk", str(args.chunk), "--verify",
            "--fail-rate", str(args.fail_rate), "--stall-rate", str(args.stall_rate),
            "--span-timeout", str(args.span_timeout), "--corrupt-rate", str(args.corrupt_rate),
            "--cancel-rate", str(args.cancel_rate), "--restart-producers",
            *[x for k in kills for x in ("--kill-producer", k)],
            "--trace", str(folder / "trace.jsonl"), "--results", str(folder / "results.jsonl"),
            "--json", "--no-progress"]


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _session(sid: int) -> list[int]:
    """Live processes of session `sid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z" and int(fields[3]) == sid:
                out.append(int(entry.name))
    return out


def _serve(cmd: list[str], timeout: float) -> dict:
    """Run the command, sampling the decoder's RSS each second; what happened."""
    samples: list[tuple[float, int]] = []
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, cwd=ROOT)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            rss = _rss_kib(proc.pid)
            if rss is not None:
                samples.append((time.perf_counter() - start, rss))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    hang = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hang = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    stop.set()
    sampler.join()
    time.sleep(1.0)
    left = _session(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return {"code": proc.returncode, "stdout": out.decode(), "stderr": err.decode()[-2000:],
            "hang": hang, "wall_s": time.perf_counter() - start, "rss": samples,
            "left": left}


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _rss_growth(samples, warmup: float) -> dict:
    """RSS at the end of warm-up (median of the samples in [warmup, warmup + 0.1] of the
    wall) and at the end (median of the last 10%)."""
    if len(samples) < 10:
        return {"rss_warm_mib": None, "rss_end_mib": None, "rss_growth": None}
    wall = samples[-1][0]
    warm = _median([r for t, r in samples if warmup * wall <= t <= (warmup + 0.1) * wall])
    end = _median([r for t, r in samples if t >= 0.9 * wall])
    return {"rss_warm_mib": warm / 1024, "rss_end_mib": end / 1024,
            "rss_max_mib": max(r for _, r in samples) / 1024, "rss_growth": end / warm - 1}


def _wrong_tokens(results_path: Path, lines: list[dict], refs) -> tuple[int, dict]:
    results = [json.loads(x) for x in results_path.read_text().splitlines()]
    tokens = {x["req"]: tuple(x["tokens"]) for x in lines}
    wrong = sum(r["status"] == "ok" and r["output"] != refs[tokens[r["req"]]] for r in results)
    reasons: dict[str, int] = {}
    for r in results:
        if r["status"] == "failed":
            key = re.sub(r"\d+", "N", r["reason"].split("(")[0]).strip()
            reasons[key] = reasons.get(key, 0) + 1
    return wrong, reasons


def soak(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="pdgpu-soak-") as tmp:
        folder = Path(args.out or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        distinct, lines = _prompts(args)
        (folder / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        t0 = time.perf_counter()
        refs = _references(args, distinct)
        ref_s = time.perf_counter() - t0
        cmd = _command(args, folder)
        run = _serve(cmd, args.timeout)
        summary = json.loads(run["stdout"]) if run["stdout"].strip() else {}
        trace = folder / "trace.jsonl"
        verdict = check_file(str(trace)) if trace.exists() else None
        results = folder / "results.jsonl"
        wrong, reasons = _wrong_tokens(results, lines, refs) if results.exists() else (None, {})
        report = {
            "requests": args.requests, "producers": args.producers, "exit_code": run["code"],
            "hang": run["hang"], "process_wall_s": run["wall_s"],
            "serve_wall_s": summary.get("wall_s"),
            "requests_per_s": (args.requests / summary["wall_s"]) if summary else None,
            **{k: summary.get(k) for k in ("ok", "cancelled", "failed", "leaked_pages", "lives",
                                           "failed_spans", "producer_kills", "producer_deaths",
                                           "producer_restarts", "tokens_per_s")},
            "failed_reasons": reasons,
            "trace_legal": bool(verdict and verdict.ok),
            "trace_events": verdict.events if verdict else None,
            "trace_violation": None if verdict is None or verdict.ok else
            f"{verdict.code} line {verdict.line}: {verdict.message}",
            "wrong_tokens": wrong, "processes_left": len(run["left"]),
            **_rss_growth(run["rss"], args.warmup),
            "references_s": ref_s, "stderr_tail": run["stderr"][-500:],
            "command": " ".join(cmd),
        }
        if args.out:
            (folder / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        return report


def missed(report: dict) -> list[str]:
    """The targets the run missed."""
    out = []
    if report["hang"]:
        out.append("hang: the run did not end within --timeout")
    if report["leaked_pages"] != 0:
        out.append(f"leaked_pages {report['leaked_pages']} (target 0)")
    if not report["trace_legal"]:
        out.append(f"illegal trace: {report['trace_violation']}")
    if report["wrong_tokens"] != 0:
        out.append(f"wrong tokens in {report['wrong_tokens']} ok requests (target 0)")
    growth = report.get("rss_growth")
    if growth is None or growth >= 0.10:
        out.append(f"RSS growth after warm-up {growth} (target < 10%)")
    if report["processes_left"]:
        out.append(f"{report['processes_left']} processes left")
    if report["exit_code"] not in (0, 1):
        out.append(f"exit code {report['exit_code']}")
    return out


def main(argv=None) -> int:
    args = _args(argv)
    report = soak(args)
    report["missed"] = missed(report)
    print(json.dumps(report, indent=1))
    return 1 if report["missed"] else 0


if __name__ == "__main__":
    sys.exit(main())
