"""The first token's message round trip in serving (`serve_latency_s`): a delay before the
decoder has the token, not producer or core time; calibrate keeps it apart from head_s."""

import json

import attrs
import pytest

from pdref.geometry import Geometry
from pdref.models import load_model
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import Costs, costs_for
from pdsim.core.engines import load_engine
from pdsim.core.play import simulate
from pdsim.core.profiles import hw_from_dict, link_of, load_hw
from pdsim.fit.calibrate import calibrate, profile_toml
from pdsim.fit.samples import SERVE_SOURCE
from pdsim.views.report import write_trace

GEO = Geometry(layers=2, kv_heads=1, head_dim=4, dtype_bytes=2, page_tokens=4)
COSTS = Costs(token_s=1e-5, pair_s=0.0, chunk_s=1e-3, span_s=1e-5, gather_byte_s=1e-12,
              link_stages=(("h2d", 1e-12),), link_latency_s=0.0, decode_s=0.01,
              decode_row_s=0.001, decode_kv_token_s=1e-5, head_s=0.002, serve_latency_s=0.05)


def run(mode: str, host_cores: float | None):
    cfg = SimConfig(GEO, attrs.evolve(COSTS, host_cores=host_cores), mode, 32, max_pending=2,
                    pool_pages=4096, output_tokens=4, stages=True, concurrency=2)
    return simulate(cfg, [RequestSpec("a", 0.0, 64, 0, 4), RequestSpec("b", 0.0, 64, 0, 4)])


@pytest.mark.parametrize("host_cores", [None, 1.0])
@pytest.mark.parametrize("mode", ["whole", "chunk"])
def test_the_latency_delays_the_first_token_not_the_next_prefill(mode, host_cores):
    """With one producer, b's prefill starts as a's LM head ends (the round trip holds no
    producer and no core), and a's first token reaches the decoder the latency later."""
    result = run(mode, host_cores)
    stages = [e for e in result.events if e.kind == "stage"]
    head_end = next(e.end for e in stages if e.name == "head" and e.req == "a")
    b_start = min(e.t for e in stages if e.name == "compute" and e.req == "b")
    produced = next(e.t for e in result.events if e.kind == "produced" and e.req == "a")
    assert b_start == pytest.approx(head_end)
    assert produced == pytest.approx(head_end + COSTS.serve_latency_s)


def test_a_profile_carries_the_latency_into_the_costs():
    """`[compute] serve_latency_s` of a profile becomes Costs.serve_latency_s (absent: 0)."""
    base, seed = load_hw("a100-pcie"), load_engine("seed-eager")
    spec = load_model("tiny")
    with_it = attrs.evolve(seed, compute=attrs.evolve(seed.compute, serve_latency_s=0.02))
    assert costs_for(spec, base, link_of(base), with_it).serve_latency_s == 0.02
    assert costs_for(spec, base, link_of(base), seed).serve_latency_s == 0.0
    bad = {"name": "x", "link": "pcie4-x16", "peak_flops": 1e12, "hbm_bandwidth": 1e11,
           "efficiency": 0.5, "chunk_s": 0.0, "gather_bandwidth": 1e10, "span_s": 0.0,
           "contention": 0.0, "compute": {"serve_latency_s": -1.0}}
    with pytest.raises(Exception, match="serve_latency_s"):
        hw_from_dict(bad, default_name="x", where="x.toml")


def test_calibrate_keeps_the_round_trip_apart_from_the_head(tmp_path):
    """A serving trace whose first tokens came the latency after their LM head: calibrate
    gives head_s the head stages alone and serve_latency_s the round trip."""
    cfg = SimConfig(GEO, COSTS, "chunk", 32, max_pending=2, pool_pages=4096, output_tokens=3,
                    stages=True, concurrency=1, labels=(("model", "tiny"),))
    result = simulate(cfg, [RequestSpec(f"r{i}", 0.0, 40 + 8 * i, 0, 3) for i in range(6)])
    path = tmp_path / "trace.jsonl"
    write_trace(str(path), result)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["source"] = SERVE_SOURCE
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    cal = calibrate([str(path)])
    assert cal.head_s == pytest.approx(COSTS.head_s, rel=1e-6)
    assert cal.serve_latency_s == pytest.approx(COSTS.serve_latency_s, rel=1e-6)


def _serving_trace(tmp_path, concurrency: int) -> str:
    cfg = SimConfig(GEO, COSTS, "chunk", 32, max_pending=2, pool_pages=4096, output_tokens=3,
                    stages=True, concurrency=concurrency, labels=(("model", "tiny"),))
    result = simulate(cfg, [RequestSpec(f"r{i}", 0.0, 40 + 8 * i, 0, 3) for i in range(6)])
    path = tmp_path / f"trace-c{concurrency}.jsonl"
    write_trace(str(path), result)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header["source"] = SERVE_SOURCE
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    return str(path)


def test_calibrate_says_when_no_request_shows_the_round_trip(tmp_path):
    """Every request found its producer busy (all six in at once): serve_latency_s is not
    fitted, and the profile says so instead of leaving the line out as if it were 0."""
    busy = calibrate([_serving_trace(tmp_path, 6)])
    assert busy.serve_latency_unfitted and busy.serve_latency_s == 0.0
    text = profile_toml(busy, load_hw("a100-pcie"), "busy")
    assert "serve_latency_s = 0.0  # NOT FITTED" in text
    one = calibrate([_serving_trace(tmp_path, 1)])
    # one at a time: every request but the first (left out as warm-up) shows it
    assert not one.serve_latency_unfitted and one.serve_latency_samples == 5
    assert "median of 5 requests" in profile_toml(one, load_hw("a100-pcie"), "one")
