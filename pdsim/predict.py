"""The simulator's prediction of one engine configuration, from a (calibrated) hw profile.

A paced engine run (`pdgpu --link-gbps G`) holds each host->decoder copy for at least
bytes / G: the prediction slows the profile's `h2d` stage to that rate (never speeds it up).
"""

from __future__ import annotations

import attrs

from pdsim.config import RequestSpec, SimConfig
from pdsim.costs import Costs, costs_for, sim_geometry
from pdsim.engine_runs import EnginePoint
from pdsim.metrics import single_metrics
from pdsim.profiles import link_of, load_hw
from pdsim.sim import SimResult, simulate

PACED_STAGE = "h2d"


def paced(costs: Costs, link_gbps: float | None) -> Costs:
    """The costs of a run whose h2d stage is paced to `link_gbps` (1e9 bytes/s)."""
    if not link_gbps:
        return costs
    floor = 1.0 / (link_gbps * 1e9)
    stages = tuple((n, max(s, floor) if n == PACED_STAGE else s) for n, s in costs.link_stages)
    return attrs.evolve(costs, link_stages=stages)


def sim_config(model, hw_path: str, point: EnginePoint, mode: str,
               page_tokens: int = 16) -> SimConfig:
    """The SimConfig of `point` in `mode` for a model spec on a hw profile."""
    hw = load_hw(hw_path)
    costs = paced(costs_for(model, hw, link_of(hw)), point.link_gbps)
    geometry = sim_geometry(model, page_tokens)
    pool = max(1, geometry.pages_for(point.prompt - point.prefix))
    labels = (("model", model.name), ("hw", hw.name))
    return SimConfig(geometry, costs, mode, point.chunk, max_pending=point.max_pending,
                     pool_pages=pool, labels=labels)


def simulate_point(model, hw_path: str, point: EnginePoint, mode: str) -> SimResult:
    cfg = sim_config(model, hw_path, point, mode)
    return simulate(cfg, [RequestSpec("r0", 0.0, point.prompt, point.prefix)])


def predict(model, hw_path: str, point: EnginePoint, mode: str) -> dict:
    """contract.md metrics of the simulated run (handoff_s, tail_s, peak_staging_bytes, ...)."""
    return single_metrics(simulate_point(model, hw_path, point, mode))
