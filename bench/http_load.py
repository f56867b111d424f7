"""Open-loop load against `pdgpu serve --http`, and the front end's own overhead (issue 25).

One workload (prompts drawn like `pdgpu serve --requests`, Poisson arrival times of `--rate`
from `--seed`, exactly the batch mode's), served twice in the same run, in alternating order
over `--rounds`:
  batch  `pdgpu serve --prompts FILE --rate R --json` (the decoder takes each request at its
         arrival time; its own summary)
  http   `pdgpu serve --http 127.0.0.1:0`, and here an asyncio client (httpx, streaming) that
         sends each request at its arrival time whether or not earlier ones finished (open
         loop) and times every token event as it arrives: TTFT from the scheduled send, ITL
         between events.
Reported with `pdgpu serve --json`'s names (requests ok failed tokens_per_s ttft_p50_s
ttft_p99_s itl_p50_s itl_p99_s, plus requests_per_s and errors) for each, the server's own
summary of the http run (the decoder's view: what the HTTP layer adds is the difference), and
per round the ratio http/batch of tokens/s and the TTFT p50 difference (target: tokens/s
within 10%, TTFT p50 within 20 ms).

    python bench/http_load.py                       # tiny, 64 requests at 8/s, 2 rounds
    python bench/http_load.py --model small --requests 32 --rate 2 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdgpu.serve.report import percentile
from pdgpu.serve.workload import draw_requests, poisson_arrivals
from pdref.models import load_model

NAMES = ("requests", "ok", "failed", "errors", "requests_per_s", "tokens_per_s", "ttft_p50_s",
         "ttft_p99_s", "itl_p50_s", "itl_p99_s")


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    p.add_argument("--prompt-range", default="64:128")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def _common(args) -> list[str]:
    return [sys.executable, "-m", "pdgpu", "serve", "--model", args.model, "--producers",
            str(args.producers), "--chunk", str(args.chunk), "--seed", str(args.seed),
            "--output-tokens", str(args.output_tokens), "--json", "--no-progress"]


def _workload(args, folder: Path) -> tuple[Path, list, tuple[float, ...]]:
    a, b = (int(x) for x in args.prompt_range.split(":"))
    spec = load_model(args.model)
    requests, _ = draw_requests(args.requests, (a, b), 0, args.output_tokens, spec.vocab,
                                args.seed)
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"req": r.req, "tokens": list(r.tokens)}) + "\n"
                            for r in requests))
    return path, requests, poisson_arrivals(len(requests), args.rate, args.seed)


def run_batch(args, prompts: Path) -> dict:
    out = subprocess.run(_common(args) + ["--prompts", str(prompts), "--rate", str(args.rate)],
                         capture_output=True, text=True, check=True).stdout
    values = json.loads(out.strip().splitlines()[-1])
    values["errors"] = values["failed"]
    values["requests_per_s"] = values["requests"] / values["wall_s"]
    return values


async def _one(client, url, model, request, at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    sent, times, error = t0 + at, [], None
    body = {"model": model, "prompt": list(request.tokens), "stream": True,
            "max_tokens": request.output_tokens}
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                error = f"{r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"token_ids": [' in line \
                        and '"token_ids": []' not in line:
                    times.append(time.perf_counter())
                elif line.startswith('data: {"error"'):
                    error = line[6:200]
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    return {"sent": sent, "times": times, "error": error}


async def _load(url: str, model: str, requests, arrivals) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter() + 0.2  # every task scheduled before the first arrival
        tasks = [_one(client, url, model, r, at, t0)
                 for r, at in zip(requests, arrivals, strict=True)]
        return await asyncio.gather(*tasks), t0


def client_summary(results: list[dict], t0: float) -> dict:
    ok = [r for r in results if r["error"] is None and r["times"]]
    ttft = [r["times"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:], strict=False)]
    end = max((r["times"][-1] for r in ok), default=t0)
    wall = end - t0
    tokens = sum(len(r["times"]) for r in ok)
    return {"requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
            "errors": len(results) - len(ok),
            "requests_per_s": len(ok) / wall if wall > 0 else None,
            "tokens_per_s": tokens / wall if wall > 0 else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "wall_s": wall, "generated_tokens": tokens}


def run_http(args, requests, arrivals) -> tuple[dict, dict]:
    cmd = _common(args) + ["--http", "127.0.0.1:0", "--http-max-prompt",
                           args.prompt_range.split(":")[1], "--http-queue", "1024"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = _port(proc)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client() as http:  # one client: a new one loads the CA bundle each poll
            while http.get(f"{base}/health").status_code != 200:
                time.sleep(0.1)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        results, t0 = asyncio.run(_load(f"{base}/v1/completions", model, requests, arrivals))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return client_summary(results, t0), json.loads(out.strip().splitlines()[-1])


def _port(proc) -> int:
    for line in proc.stderr:
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if found:
            return int(found.group(1))
    raise RuntimeError(f"pdgpu serve --http ended before listening (exit {proc.wait()})")


def _row(name: str, values: dict) -> str:
    cells = []
    for key in NAMES:
        v = values.get(key)
        cells.append("-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v)))
    return f"{name:>12} " + " ".join(f"{c:>10}" for c in cells)


def main() -> None:
    args = _args()
    with tempfile.TemporaryDirectory() as tmp:
        prompts, requests, arrivals = _workload(args, Path(tmp))
        rounds = []
        for i in range(args.rounds):
            order = ("batch", "http") if i % 2 == 0 else ("http", "batch")
            got = {}
            for kind in order:
                if kind == "batch":
                    got["batch"] = run_batch(args, prompts)
                else:
                    got["http"], got["http_server"] = run_http(args, requests, arrivals)
            got["tokens_per_s_ratio"] = got["http"]["tokens_per_s"] / \
                got["batch"]["tokens_per_s"]
            got["ttft_p50_diff_s"] = got["http"]["ttft_p50_s"] - got["batch"]["ttft_p50_s"]
            rounds.append(got)
    _report(args, rounds)


def _report(args, rounds: list[dict]) -> None:
    ratio = statistics.median(r["tokens_per_s_ratio"] for r in rounds)
    diff = statistics.median(r["ttft_p50_diff_s"] for r in rounds)
    if args.json:
        print(json.dumps({"rounds": rounds, "tokens_per_s_ratio": ratio,
                          "ttft_p50_diff_s": diff}))
        return
    print(f"{args.model}, {args.requests} requests at {args.rate}/s, prompts "
          f"{args.prompt_range}, {args.output_tokens} out, {args.producers} producer(s)")
    print(" " * 13 + " ".join(f"{n[:10]:>10}" for n in NAMES))
    for i, r in enumerate(rounds):
        for kind in ("batch", "http", "http_server"):
            print(_row(f"{i}:{kind}", r[kind]))
        print(f"   round {i}: tokens/s http/batch {r['tokens_per_s_ratio']:.3f}, TTFT p50 "
              f"http - batch {1000 * r['ttft_p50_diff_s']:+.1f} ms")
    print(f"median: tokens/s http/batch {ratio:.3f} (target >= 0.90), TTFT p50 difference "
          f"{1000 * diff:+.1f} ms (target <= 20 ms)")


if __name__ == "__main__":
    main()
