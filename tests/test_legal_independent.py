"""Traces legal by two paths: the hand-written examples, the simulator's traces (with faults)
and the engine's traces pass both pdref's checker and an independent reading of the contract
(tests/legal_helpers.py, sharing no code with pdref); and that reading refuses the shipped
illegal examples of the rules it knows, so its 'no problem' means something."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from legal_helpers import first_problem

from pdref import events as ev
from pdref.check import check_lines
from pdref.models import load_model
from pdref.trace import dumps
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import costs_for, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.faults import FaultSpec
from pdsim.core.play import simulate
from pdsim.core.profiles import link_of, load_hw

EXAMPLES = Path(__file__).resolve().parent.parent / "specs" / "examples"
SPEC = load_model("qwen3-0.6b")
A100 = load_hw("a100-pcie")
COSTS = costs_for(SPEC, A100, link_of(A100), load_engine("seed-eager"))
# The illegal examples whose broken rule the independent reading knows (file name stem).
KNOWN = ["ADM-1-admit-after-fenced-failure", "ADM-1-admit-before-produced",
         "ADM-1-admit-with-failed-span", "LIFE-1-release-before-admit",
         "LIFE-1-trace-ends-holding-pages", "LIFE-1-trace-ends-with-unfenced-span",
         "REQ-1-fence-of-a-landed-span", "REQ-1-fence-twice", "REQ-1-land-twice",
         "REQ-1-span-id-reused", "SLAB-1-page-held-by-another-slab",
         "SLAB-2-prefix-not-page-aligned", "TRACE-2-time-goes-back",
         "CACHE-1-hit-on-an-evicted-page", "CACHE-1-hit-on-a-page-still-written",
         "EVICT-1-evict-a-page-a-live-life-holds"]


def lines_of(header, events) -> list[bytes]:
    return [dumps(ev.header_to_json(header)).encode()] + [
        dumps(ev.event_to_json(e)).encode() for e in events]


def legal_both_ways(lines: list[bytes]) -> None:
    verdict = check_lines(lines)
    assert verdict.ok, verdict.text()
    assert first_problem(lines) is None, first_problem(lines)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("legal-*.jsonl")), ids=lambda p: p.name)
def test_legal_examples_are_legal_by_both_readings(path):
    """Each shipped legal example (hand-written ones too) passes both readings."""
    legal_both_ways(path.read_bytes().splitlines())


@pytest.mark.parametrize("stem", KNOWN)
def test_independent_reading_refuses_the_illegal_examples_it_knows(stem):
    """The independent reading finds a problem in each illegal example of a rule it knows."""
    path = EXAMPLES / f"illegal-{stem}.jsonl"
    assert first_problem(path.read_bytes().splitlines()) is not None


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["whole", "chunk", "layer"]), st.integers(1, 4),
       st.sampled_from([0.0, 0.2]), st.sampled_from([0.0, 0.2]), st.integers(0, 2**16))
def test_simulator_traces_are_legal_by_both_readings(mode, requests, fail, cancel, seed):
    """The simulator's own traces (several requests, failures, cancellations) pass both."""
    cfg = SimConfig(sim_geometry(SPEC), COSTS, mode, 256, pool_pages=1024, producers=2,
                    stages=True)
    specs = [RequestSpec(f"r{i}", 0.001 * i, 600 + 300 * i, 256 * (i % 2))
             for i in range(requests)]
    faults = FaultSpec(fail_rate=fail, cancel_rate=cancel, seed=seed)
    result = simulate(cfg, specs, faults=faults)
    legal_both_ways(lines_of(result.header, result.trace_events()))


def test_engine_traces_are_legal_by_both_readings():
    """The engine's own traces (CPU, each mode, a prefix and two requests) pass both."""
    torch = pytest.importorskip("torch")
    from pdgpu.engine import Engine
    from pdgpu.model import build_model
    from pdgpu.workload import EngineConfig, Request

    model = build_model(attrs.evolve(load_model("tiny"), dtype="float32"), seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = [tuple(torch.randint(0, model.spec.vocab, (n,), generator=gen).tolist())
              for n in (40, 23)]
    for mode in ("whole", "chunk", "layer"):
        requests = [Request("a", tokens[0], 0), Request("b", tokens[1], 16)]
        result = Engine(model, EngineConfig(mode, chunk=16)).run(requests)
        legal_both_ways(lines_of(result.header, result.events))
