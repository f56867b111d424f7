"""`pdsim sweep --requests N --rate R`: each grid point a serving workload, not one request.

A point's workload is N requests of the point's prompt, Poisson at R requests/s (seeded),
each generating `--output-tokens`; its pool holds 16 of them (pdsim run's default). The
worker draws the requests as the run reads them and runs them streamed (stream.py), so a
point of a million requests holds what is in flight, in a pool process or a Ray worker
alike: each row says its worker's peak RSS so far (`peak_rss_mb`). Rows: pdgpu serve's
latencies and rates; the best point per prompt: the lowest TTFT p99.
"""

from __future__ import annotations

import resource
import sys

import attrs

from pdsim.core.config import SimConfig
from pdsim.core.metrics import workload_metrics
from pdsim.core.play import simulate
from pdsim.core.stream import RunStream
from pdsim.core.workload import GeneratedWorkload, WorkloadSpec

COLUMNS = ("mode", "prompt", "chunk", "max_pending", "bandwidth_scale", "requests", "rate",
           "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "tokens_per_s", "makespan_s",
           "pool_occupancy_mean", "peak_rss_mb")


@attrs.frozen
class Load:
    """The workload every point runs."""

    requests: int
    rate: float
    output_tokens: int = 0
    seed: int = 0


def evaluate_load(base: SimConfig, point, prefix: int, load: Load) -> dict:
    """Simulate the point's workload, streamed (no stage events: metrics only)."""
    cfg = attrs.evolve(base, mode=point.mode, chunk=point.chunk, max_pending=point.max_pending,
                       costs=base.costs.scaled(bandwidth=point.bandwidth_scale), stages=False,
                       output_tokens=load.output_tokens)
    cfg = attrs.evolve(cfg, pool_pages=16 * cfg.geometry.pages_for(point.prompt - prefix))
    spec = WorkloadSpec(load.requests, point.prompt, prefix, rate=load.rate, seed=load.seed)
    requests = GeneratedWorkload(spec, cfg.geometry.page_tokens)
    m = workload_metrics(simulate(cfg, requests, stream=RunStream(cfg)))
    m.update(prompt=point.prompt, bandwidth_scale=point.bandwidth_scale, rate=load.rate,
             peak_rss_mb=round(peak_rss_mb()))
    return {k: m[k] for k in COLUMNS}


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, MB (ru_maxrss: KB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def best_points(rows: list[dict]) -> dict[int, dict]:
    """Per prompt, the row with the lowest TTFT p99 (ties: the smaller chunk)."""
    best: dict[int, dict] = {}
    for row in rows:
        current = best.get(row["prompt"])
        if current is None or (row["ttft_p99_s"], row["chunk"]) < (current["ttft_p99_s"],
                                                                    current["chunk"]):
            best[row["prompt"]] = row
    return best


def format_table(rows: list[dict]) -> str:
    head = (f"{'mode':6} {'prompt':>7} {'chunk':>6} {'pend':>4} {'bw':>5} {'requests':>9} "
            f"{'ttft p50 ms':>11} {'ttft p99 ms':>11} {'tokens/s':>9} {'RSS MB':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['mode']:6} {r['prompt']:7d} {r['chunk']:6d} {r['max_pending']:4d} "
                     f"{r['bandwidth_scale']:5.3g} {r['requests']:9d} "
                     f"{r['ttft_p50_s'] * 1e3:11.3f} {r['ttft_p99_s'] * 1e3:11.3f} "
                     f"{r['tokens_per_s'] or 0:9.1f} {r['peak_rss_mb']:7d}")
    for prompt, r in best_points(rows).items():
        lines.append(f"best for prompt {prompt}: mode {r['mode']} chunk {r['chunk']} "
                     f"max_pending {r['max_pending']}: TTFT p99 {r['ttft_p99_s'] * 1e3:.3f} ms")
    return "\n".join(lines)
