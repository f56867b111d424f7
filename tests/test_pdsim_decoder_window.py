"""pdsim's decoder prices a sliding layer's decode row by the KV it holds: min(context,
window) tokens, not a whole window while the context is shorter (windowed KV tokens)."""

import pytest

from pdref.geometry import Geometry
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import Costs
from pdsim.core.faults import FaultSpec
from pdsim.core.play import simulate

GEO = Geometry(layers=2, kv_heads=1, head_dim=4, dtype_bytes=2, page_tokens=4)
WINDOW = 8
TERMS = dict(decode_s=0.01, decode_row_s=0.001, decode_kv_token_s=1e-5,
             decode_window_token_s=1e-4)
COSTS = Costs(token_s=1e-5, pair_s=0.0, chunk_s=1e-3, span_s=1e-5, gather_byte_s=1e-12,
              link_stages=(("h2d", 1e-12),), link_latency_s=0.0, window=WINDOW,
              decode_token_s=0.02, **TERMS)  # decode_token_s: where cancels fall (faults)


def _run(prompts, arrivals, outputs, faults=None, **kw):
    requests = [RequestSpec(f"r{i}", arrivals[i], p, 0, outputs[i])
                for i, p in enumerate(prompts)]
    cfg = SimConfig(geometry=GEO, costs=COSTS, mode="chunk", chunk=4, max_pending=2,
                    pool_pages=4096, **kw)
    return simulate(cfg, requests, faults), {r.req: r.prompt for r in requests}


def _took(record) -> list[float]:
    return [b - a for a, b in zip(record.step_start, record.step_end, strict=True)]


def _expected_steps(record, prompts, aborted=None) -> list[float]:
    """Each step's time from the rows it held, rebuilt from who decoded when (a row
    aborted at t is in the steps begun before t): a row of context c reads c KV tokens
    and min(c, WINDOW) windowed ones."""
    aborted = aborted or {}
    rows = {s: [] for s in range(record.steps)}
    for req, (_, first, steps) in record.tokens.items():
        for s in range(first, min(first + steps, record.steps)):
            if record.step_start[s] < aborted.get(req, float("inf")):
                rows[s].append(prompts[req] + s - first)
    return [TERMS["decode_s"] + len(c) * TERMS["decode_row_s"]
            + sum(c) * TERMS["decode_kv_token_s"]
            + sum(min(x, WINDOW) for x in c) * TERMS["decode_window_token_s"]
            for c in (rows[s] for s in range(record.steps))]


def test_a_short_context_reads_its_context_not_the_window():
    """One request of 3 prompt tokens and 9 outputs: its steps read 3, 4, ..., 8 windowed
    tokens, then the window's 8 (the context passed it)."""
    result, prompts = _run([3], [0.0], [9])
    took = _took(result.decode)
    windowed = [3, 4, 5, 6, 7, 8, 8, 8]
    assert took == pytest.approx([TERMS["decode_s"] + TERMS["decode_row_s"]
                                  + (3 + k) * TERMS["decode_kv_token_s"]
                                  + windowed[k] * TERMS["decode_window_token_s"]
                                  for k in range(8)], rel=1e-12)


@pytest.mark.parametrize("sender", ["blocking", "queued"])
def test_every_step_prices_each_rows_window_share(sender):
    """Requests shorter and longer than the window, overlapping, some finishing before their
    context reaches the window: every decode step takes the formula over the rows it held."""
    prompts = [2, 5, 12, 3, 7, 1, 30]
    arrivals = [0.0, 0.001, 0.002, 0.02, 0.021, 0.05, 0.05]
    outputs = [12, 3, 6, 20, 2, 9, 4]
    result, by_req = _run(prompts, arrivals, outputs, concurrency=4, sender=sender)
    record = result.decode
    assert max(record.batch) >= 3  # rows of different contexts shared steps
    assert _took(record) == pytest.approx(_expected_steps(record, by_req), rel=1e-9)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_cancelled_row_leaves_its_window_share(seed):
    """Requests cancelled at random, some while their rows decode (some mid-step): the
    steps after take the formula over the rows left."""
    prompts = [2, 5, 3, 6, 4, 1, 9, 2]
    arrivals = [0.0, 0.0, 0.001, 0.001, 0.002, 0.002, 0.003, 0.004]
    result, by_req = _run(prompts, arrivals, [14] * 8, FaultSpec(cancel_rate=0.6, seed=seed),
                          concurrency=8)
    aborted = {e.req: e.t for e in result.events if e.kind == "abort"}
    record = result.decode
    decoding = [r for r, t in aborted.items() if r in record.tokens
                and record.step_start[record.tokens[r][1]] < t]
    assert decoding  # some row was cancelled while it decoded
    assert _took(record) == pytest.approx(_expected_steps(record, by_req, aborted), rel=1e-9)
