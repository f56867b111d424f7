"""`simulate`: play a run's requests through the right simulation, the one entry point that
tools call (a plain run: sim.Sim; with active faults: fault_sim.FaultSim, which builds on
Sim). It lives above both so that neither imports the other's caller.
"""

from __future__ import annotations

from pdsim.core.config import SimConfig
from pdsim.core.fault_sim import FaultSim
from pdsim.core.sim import Sim, SimResult


def simulate(cfg: SimConfig, requests, faults=None, stream=None) -> SimResult:
    """Play `requests`; with an active `faults.FaultSpec`, through `fault_sim.FaultSim`;
    with a `stream` (no faults), keeping only what is in flight."""
    if faults is None or not faults.active:
        return Sim(cfg, requests, stream).run()
    if cfg.prefix_cache or getattr(requests, "followups", None):
        raise ValueError("faults: the prefix cache and sessions are not simulated with faults "
                         "yet (a failed turn would end its session)")
    if stream is not None:
        raise ValueError("faults: a run with faults keeps its requests; it cannot be streamed")
    return FaultSim(cfg, requests, faults).run()
