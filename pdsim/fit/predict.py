"""The simulator's prediction of one engine configuration, from a (calibrated) hw profile.

A paced engine run (`pdgpu --link-gbps G`) holds each direction of the link (its d2h and its
h2d lane) for at least bytes / G per span: the prediction slows every link stage of the
profile to that rate (never speeds one up). How spans share the copier (serial or
pipelined) is the profile's `copier`.
"""

from __future__ import annotations

import attrs

from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import Costs, costs_for, engine_of, sim_geometry
from pdsim.core.metrics import single_metrics
from pdsim.core.play import simulate
from pdsim.core.profiles import link_of, load_hw
from pdsim.core.sim import SimResult
from pdsim.fit.engine_runs import EnginePoint, ExportPoint


def paced(costs: Costs, link_gbps: float | None) -> Costs:
    """The costs of a run whose link directions are each paced to `link_gbps` (1e9 B/s)."""
    if not link_gbps:
        return costs
    floor = 1.0 / (link_gbps * 1e9)
    stages = tuple((n, max(s, floor)) for n, s in costs.link_stages)
    return attrs.evolve(costs, link_stages=stages)


def sim_config(model, hw_path: str, point: EnginePoint | ExportPoint, mode: str,
               page_tokens: int = 16) -> SimConfig:
    """The SimConfig of `point` in `mode` for a model spec on a hw profile."""
    hw = load_hw(hw_path)
    engine = engine_of(hw)
    costs = paced(costs_for(model, hw, link_of(hw), engine), point.link_gbps)
    geometry = sim_geometry(model, page_tokens)
    prompt = point.prompt_tokens(geometry.bytes_per_token)
    pool = max(1, geometry.pages_for(prompt - point.prefix))
    labels = (("model", model.name), ("hw", hw.name), ("engine", engine.name))
    return SimConfig(geometry, costs, mode, point.chunk, max_pending=point.max_pending,
                     pool_pages=pool, no_compute=point.no_compute, labels=labels)


def simulate_point(model, hw_path: str, point: EnginePoint | ExportPoint, mode: str
                   ) -> SimResult:
    cfg = sim_config(model, hw_path, point, mode)
    prompt = point.prompt_tokens(cfg.geometry.bytes_per_token)
    return simulate(cfg, [RequestSpec("r0", 0.0, prompt, point.prefix)])


def predict(model, hw_path: str, point: EnginePoint | ExportPoint, mode: str) -> dict:
    """contract.md metrics of the simulated run (handoff_s, tail_s, peak_staging_bytes, ...)."""
    return single_metrics(simulate_point(model, hw_path, point, mode))
