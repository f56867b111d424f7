"""The two-stage pipeline lower bound of one request: compute feeds copies, nothing else.

Stage 1 runs the compute steps back to back (no contention, never blocked); stage 2 issues
each span to the copier (serial or pipelined, pdsim/copier.py) as soon as it is ready
(unbounded staging). Any schedule the simulator plays is at least this long, so handoff -
bound is the cost of the max_pending bound and of contention.
"""

from __future__ import annotations

from pdsim.config import RequestSpec, SimConfig
from pdsim.copier import Copier
from pdsim.steps import copied_bytes, plan_steps, span_copy_s


def lower_bound_s(cfg: SimConfig, request: RequestSpec) -> float:
    """Earliest time (from the request's start) it could be admitted."""
    steps = plan_steps(cfg, request)
    total = sum(1 for s in steps for _ in s.spans)
    copier = Copier(cfg.costs)
    compute_end = copy_end = 0.0
    seen = 0
    for step in steps:
        compute_end += step.base_s
        for span in step.spans:
            seen += 1
            nbytes = copied_bytes(cfg, span.bytes(cfg.geometry), seen == total)
            copy_end = max(copy_end, copier.schedule(compute_end, nbytes).land)
    return max(compute_end, copy_end)


def copy_total_s(cfg: SimConfig, request: RequestSpec) -> float:
    """Total time of the request's span copies, each alone (on a serial copier: the time
    its worker is busy)."""
    spans = [s for step in plan_steps(cfg, request) for s in step.spans]
    return sum(
        span_copy_s(cfg, s.bytes(cfg.geometry), i == len(spans) - 1) for i, s in enumerate(spans)
    )
