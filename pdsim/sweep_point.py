"""One point of `pdsim sweep`'s grid and its evaluation: what a worker runs, whether a
process of the local pool (sweep.py) or a Ray task (ray_sweep.py). Both of those import it;
it imports neither.
"""

from __future__ import annotations

import attrs

from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.metrics import single_metrics
from pdsim.core.play import simulate
from pdsim.sweep_load import Load, evaluate_load

COLUMNS = ("mode", "prompt", "chunk", "max_pending", "bandwidth_scale", "prefill_s",
           "handoff_s", "tail_s", "peak_staging_bytes", "spans", "lower_bound_s", "gap_s")


@attrs.frozen
class Point:
    """One configuration of the grid."""

    mode: str
    prompt: int
    chunk: int
    max_pending: int
    bandwidth_scale: float


def evaluate(base: SimConfig, point: Point, prefix: int = 0, load: Load | None = None) -> dict:
    """Simulate one grid point (no stage events: metrics only); with a `load`, its workload
    (sweep_load.py)."""
    if load is not None:
        return evaluate_load(base, point, prefix, load)
    cfg = attrs.evolve(base, mode=point.mode, chunk=point.chunk, max_pending=point.max_pending,
                       costs=base.costs.scaled(bandwidth=point.bandwidth_scale), stages=False)
    cfg = attrs.evolve(cfg, pool_pages=max(1, cfg.geometry.pages_for(point.prompt - prefix)))
    m = single_metrics(simulate(cfg, [RequestSpec("r0", 0.0, point.prompt, prefix)]))
    m["bandwidth_scale"] = point.bandwidth_scale
    return {k: m[k] for k in COLUMNS}
