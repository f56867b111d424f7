"""One call to simulate a serving configuration, for tools built on the simulator (for
example a validation against `pdgpu serve`): the config, the workload, the summary.

    cfg = serving_config(SimConfig(geometry, costs, "chunk", 64, ...), requests,
                         concurrency=4)
    summary = simulate_serving(cfg, requests)   # pdgpu serve's keys and pdsim's

`serving_config` fills what the engine decides itself when it is not given: its sender
(queued: pdgpu serve's sender thread), its producers' source cache (two of the longest
suffixes), and its decoder pool (the slabs of the largest requests that may be in at once:
C of them in a closed loop, else up to 8).
"""

from __future__ import annotations

import attrs

from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.metrics import workload_metrics
from pdsim.core.play import simulate
from pdsim.core.workload import WorkloadSpec, build_requests

__all__ = ["WorkloadSpec", "build_requests", "serving_config", "simulate_serving"]


def serving_config(cfg: SimConfig, requests: list[RequestSpec], concurrency: int | None = None,
                   pool_pages: int | None = None, source_pages: int | None = None,
                   sender: str = "queued") -> SimConfig:
    """`cfg` set up as `pdgpu serve` runs `requests` (None: the engine's own default)."""
    suffixes = sorted((cfg.geometry.pages_for(r.prompt - r.prefix) for r in requests),
                      reverse=True)
    at_once = concurrency if concurrency is not None else min(8, len(suffixes))
    return attrs.evolve(cfg, concurrency=concurrency, sender=sender,
                        pool_pages=pool_pages or max(1, sum(suffixes[:at_once])),
                        source_pages=source_pages or 2 * suffixes[0])


def simulate_serving(cfg: SimConfig, requests: list[RequestSpec], faults=None) -> dict:
    """Play `requests` under `cfg`; the summary: pdgpu serve's keys (`requests`, `ok`,
    `tokens_per_s`, `ttft_p50_s`, `ttft_p99_s`, `itl_p50_s`, `itl_p99_s`, `handoff_p50_s`,
    `peak_pool_pages`, `leaked_pages`, `wall_s` in simulated seconds) and pdsim's."""
    return workload_metrics(simulate(cfg, requests, faults))
