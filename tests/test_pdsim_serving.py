"""pdsim's serving model: the decoder's continuous batch, producer queues, closed loop,
prompt files, pdgpu serve's summary, and the serving options' bad input."""

import json

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdref.check import check_file
from pdref.geometry import Geometry
from pdref.models import ProfileError, load_model
from pdsim.cli import main
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.costs import Costs, costs_for, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.faults import FaultSpec, Kill
from pdsim.core.metrics import workload_metrics
from pdsim.core.play import simulate
from pdsim.core.profiles import hw_from_dict, load_hw, load_link
from pdsim.core.serving import serving_config, simulate_serving
from pdsim.core.serving_metrics import inter_token_gaps
from pdsim.views.report import write_trace

MODE_NAMES = ("whole", "chunk", "layer")
GEO = Geometry(layers=2, kv_heads=1, head_dim=4, dtype_bytes=2, page_tokens=4)
DECODE = dict(decode_s=0.01, decode_row_s=0.001, decode_kv_token_s=1e-5)
COSTS = Costs(token_s=1e-5, pair_s=0.0, chunk_s=1e-3, span_s=1e-5, gather_byte_s=1e-12,
              link_stages=(("h2d", 1e-12),), link_latency_s=0.0, **DECODE)


def cfg(**kw) -> SimConfig:
    base = dict(geometry=GEO, costs=COSTS, mode="chunk", chunk=32, max_pending=2,
                pool_pages=4096)
    base.update(kw)
    return SimConfig(**base)


def reqs(*prompts, outputs=None, arrivals=None) -> list[RequestSpec]:
    outputs = outputs or [None] * len(prompts)
    arrivals = arrivals or [0.0] * len(prompts)
    return [RequestSpec(f"r{i}", arrivals[i], p, 0, outputs[i])
            for i, p in enumerate(prompts)]


def step_s(batch: int, kv: int) -> float:
    return DECODE["decode_s"] + batch * DECODE["decode_row_s"] + kv * DECODE["decode_kv_token_s"]


def times(result, kind: str) -> dict[str, float]:
    return {e.req: e.t for e in result.events if e.kind == kind}


def decode_stages(result) -> list:
    return [e for e in result.trace_events() if e.kind == "stage" and e.name == "decode"]


def test_one_request_decodes_by_hand():
    """One request of 5 tokens: 4 steps of the formula's time back to back after admission;
    tokens/s, wall and ITL are what the hand computes."""
    result = simulate(cfg(output_tokens=5), reqs(64))
    m = workload_metrics(result)
    admit, produced = times(result, "admit")["r0"], times(result, "produced")["r0"]
    steps = [step_s(1, 64 + k) for k in range(4)]
    assert m["decode_steps"] == 4 and m["generated_tokens"] == 5
    assert m["wall_s"] == pytest.approx(admit + sum(steps))
    assert m["tokens_per_s"] == pytest.approx(5 / (admit + sum(steps)))
    gaps = sorted([admit - produced + steps[0], *steps[1:]])
    assert m["itl_p99_s"] == pytest.approx(gaps[-1])
    assert m["itl_p50_s"] == pytest.approx(gaps[1])  # nearest rank: 2nd of 4
    assert m["ttft_p50_s"] == pytest.approx(produced)


def test_every_decode_stage_takes_the_step_formula_and_rows_add_up():
    """Each decode stage lasts decode_s + batch*row + kv*kv_token; batches add up to the
    rows decoded (outputs - 1 per request); a lone request's first step reads its prompt."""
    result = simulate(cfg(output_tokens=6), reqs(40, 64, 100, arrivals=[0.0, 0.003, 0.5]))
    stages = decode_stages(result)
    for s in stages:
        assert s.end - s.t == pytest.approx(step_s(s.batch, s.kv_tokens))
    assert sum(s.batch for s in stages) == 3 * 5
    assert max(s.batch for s in stages) >= 2  # the first two overlapped
    last = [s for s in stages if s.t >= times(result, "admit")["r2"]]
    assert last[0].batch == 1 and last[0].kv_tokens == 100


def test_a_larger_batch_amortizes_decode_s():
    """Four requests decoded together take fewer, shared steps and give more tokens/s than
    the same four one at a time."""
    requests = reqs(32, 32, 32, 32)
    together = workload_metrics(simulate(cfg(output_tokens=20, concurrency=4), requests))
    alone = workload_metrics(simulate(cfg(output_tokens=20, concurrency=1), requests))
    assert alone["decode_steps"] == 4 * 19
    assert together["decode_steps"] < 2 * 19
    assert together["tokens_per_s"] > 2 * alone["tokens_per_s"]


def test_admissions_wait_for_the_running_step_to_end():
    """A request whose spans land while a step runs is admitted at that step's end (pdgpu's
    loop handles messages between steps), never in the middle of one."""
    result = simulate(cfg(output_tokens=40), reqs(32, 32, 32, arrivals=[0.0, 0.02, 0.05]))
    stages = decode_stages(result)
    ends = {round(s.end, 12) for s in stages}
    for req, t in times(result, "admit").items():
        inside = [s for s in stages if s.t < t < s.end]
        assert not inside, f"{req} admitted inside a step"
    late = [t for req, t in times(result, "admit").items() if req != "r0"]
    assert all(round(t, 12) in ends for t in late)


def test_closed_loop_never_exceeds_the_concurrency_and_reaches_it():
    """With --concurrency 3, at no moment are more than 3 requests between entering and
    release, 3 are at some moment, and each later one enters at a release."""
    result = simulate(cfg(output_tokens=8, concurrency=3, producers=2),
                      reqs(*[32 + 8 * i for i in range(12)]))
    entered = {r.req: r.arrival for r in result.requests}
    released = times(result, "release")
    assert len(released) == 12
    moments = sorted(set(entered.values()) | set(released.values()))
    inside = [sum(entered[r] <= t < released[r] for r in entered) for t in moments]
    assert max(inside) == 3
    later = sorted(entered.values())[3:]
    assert all(any(t == pytest.approx(x) for x in released.values()) for t in later)


def test_reservations_follow_arrival_order_and_the_head_waits():
    """A small request behind a big one that waits for pages waits too (no overtaking)."""
    big, small = 64, 8
    pool = GEO.pages_for(big) + GEO.pages_for(small)
    result = simulate(cfg(pool_pages=pool, output_tokens=3),
                      reqs(big, big, small, arrivals=[0.0, 0.001, 0.002]))
    order = [(e.req, e.t) for e in result.events if e.kind == "reserve"]
    assert [r for r, _ in order] == ["r0", "r1", "r2"]
    assert order[2][1] >= order[1][1] >= times(result, "release")["r0"]


def test_requests_go_to_the_least_queued_producer():
    """Three requests at once on two producers: the third joins the shorter queue."""
    result = simulate(cfg(producers=2), reqs(1024, 64, 64))
    producers = [e.producer for e in result.events if e.kind == "reserve"]
    assert producers == ["p0", "p1", "p1"]


def test_source_cache_holds_the_next_prefill_until_reuse():
    """With room for one prompt's source, the producer starts the next prefill only after
    the first request's `reuse`; with an unbounded cache it starts at once."""
    slow = attrs.evolve(COSTS, link_stages=(("h2d", 1e-5),))
    requests = reqs(64, 64)
    tight = simulate(cfg(costs=slow, sender="queued", source_pages=GEO.pages_for(64)), requests)
    loose = simulate(cfg(costs=slow, sender="queued"), requests)
    first_compute = {r: min(e.t for e in res.events if e.kind == "computed" and e.req == "r1")
                     for r, res in (("tight", tight), ("loose", loose))}
    assert first_compute["tight"] >= times(tight, "reuse")["r0"]
    assert first_compute["loose"] < times(loose, "reuse")["r0"]


def test_queued_sender_lets_compute_run_ahead_of_a_slow_link():
    """pdgpu serve's sender thread: prefill ends sooner than with the blocking producer;
    never more than max_pending spans in flight either way."""
    slow = attrs.evolve(COSTS, link_stages=(("h2d", 1e-5),))
    out = {}
    for sender in ("blocking", "queued"):
        result = simulate(cfg(costs=slow, sender=sender), reqs(256))
        live = peak = 0
        for e in result.events:
            live += {"issue": 1, "land": -1}.get(e.kind, 0)
            peak = max(peak, live)
        assert peak <= 2
        out[sender] = times(result, "produced")["r0"]
    assert out["queued"] < out["blocking"] * 0.5


@pytest.mark.parametrize(("seed", "host_cores"), [(0, None), (1, None), (2, None), (3, None),
                                                  (0, 1.0), (1, 1.5)])
def test_faults_under_serving_stay_legal_and_leak_nothing(tmp_path, seed, host_cores):
    """Failures, cancels and a killed producer with a queued sender and a closed loop (on
    dedicated devices, and on shared host cores): legal trace, no page leaked, one outcome
    per request, retries spent."""
    spec, hw = load_model("qwen3-0.6b"), load_hw("a100-pcie")
    eager = load_engine("seed-eager")
    costs = attrs.evolve(costs_for(spec, hw, load_link(hw.link), eager).scaled(bandwidth=0.05),
                         host_cores=host_cores)
    config = SimConfig(sim_geometry(spec), costs, "chunk", 128, pool_pages=4 * 64, producers=2,
                       output_tokens=6, concurrency=4, sender="queued", source_pages=128)
    requests = [RequestSpec(f"r{i}", 0.0, 256 + 64 * (i % 5)) for i in range(16)]
    faults = FaultSpec(fail_rate=0.1, cancel_rate=0.2, kills=(Kill(1, 0.05),), seed=seed)
    result = simulate(config, requests, faults)
    write_trace(tmp_path / "t.jsonl", result)
    verdict = check_file(tmp_path / "t.jsonl")
    assert verdict.ok, verdict.text()
    assert result.leaked_pages == 0
    m = workload_metrics(result)
    assert m["ok"] + m["cancelled"] + m["failed"] == 16 and m["ok"] > 0
    assert m["lives"] > 16 and m["cancelled"] > 0


def test_simulate_serving_fills_the_engine_defaults():
    """serving_config sizes the pool and source cache as pdgpu serve does; the summary has
    pdgpu serve's keys."""
    requests = reqs(64, 32, 16, outputs=[3, 3, 3])
    config = serving_config(cfg(), requests, concurrency=2)
    assert config.pool_pages == GEO.pages_for(64) + GEO.pages_for(32)
    assert config.source_pages == 2 * GEO.pages_for(64) and config.sender == "queued"
    summary = simulate_serving(config, requests)
    for key in ("requests", "ok", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
                "itl_p99_s", "handoff_p50_s", "peak_pool_pages", "leaked_pages", "wall_s",
                "pool_peak_pages"):
        assert key in summary
    assert summary["generated_tokens"] == 9 and summary["ok"] == 3


def test_prompts_file_runs_with_its_names_and_output_counts(tmp_path, capsys):
    """`--prompts` in pdgpu serve's format: its request names, its output counts (a line
    without one takes --output-tokens), a trace pdref accepts."""
    lines = [{"req": "a", "tokens": list(range(40)), "output_tokens": 2},
             {"req": "b", "tokens": list(range(70)), "output_tokens": 5},
             {"req": "c", "tokens": list(range(20))}]
    prompts, trace = tmp_path / "p.jsonl", tmp_path / "t.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["run", "--prompts", str(prompts), "--concurrency", "2", "--output-tokens", "3",
            "--json", "--trace", str(trace)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3 and out["generated_tokens"] == 2 + 5 + 3
    assert check_file(trace).ok
    names = {json.loads(x).get("req") for x in trace.read_text().splitlines()[1:]}
    assert {"a", "b", "c"} <= names


def test_output_range_draws_within_its_bounds(capsys):
    """--output-range A:B: generated tokens lie between requests*A and requests*B."""
    argv = ["run", "--requests", "20", "--prompt-range", "64:256", "--output-range", "2:9",
            "--concurrency", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert 20 * 2 < out["generated_tokens"] < 20 * 9


@pytest.mark.parametrize("extra, field", [
    (["--concurrency", "0"], "--concurrency"),
    (["--output-range", "5:3"], "--output-range"),
    (["--prompts", "/nonexistent/p.jsonl"], "--prompts"),
    (["--rate", "2", "--concurrency", "2"], "--concurrency"),
    (["--interval", "0.1", "--concurrency", "2"], "--concurrency"),
    (["--source-pages", "2"], "source_pages"),
    (["--sender", "eager"], "--sender"),
])
def test_bad_serving_input_is_one_line_exit_2(capsys, extra, field):
    """Bad serving options: one line naming the field, exit 2, no traceback."""
    assert main(["run", "--requests", "3", "--prompt", "512"] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "Traceback" not in err


def test_bad_prompts_line_names_the_line(tmp_path, capsys):
    """A prompts line breaking a rule is refused naming the file's line, exit 2."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"req": "a", "tokens": [1, 2]}\n{"req": "b", "tokens": [1.5]}\n')
    assert main(["run", "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 2" in err and "tokens" in err


def test_decode_terms_from_the_profile_or_derived():
    """A profile's [compute] decode terms are used as given; absent, they are derived
    (weights once per step at HBM bandwidth, a KV token's bytes at HBM bandwidth); a
    negative one is refused naming it."""
    spec, hw = load_model("qwen3-0.6b"), load_hw("a100-pcie")
    seed = load_engine("seed-eager")
    derived = costs_for(spec, hw, load_link(hw.link), seed)
    assert derived.decode_s == pytest.approx(derived.decode_token_s)
    assert derived.decode_kv_token_s == pytest.approx(
        sim_geometry(spec).bytes_per_token / hw.hbm_bandwidth)
    data = {"name": "x", "link": hw.link, "peak_flops": hw.peak_flops,
            "hbm_bandwidth": hw.hbm_bandwidth, "efficiency": seed.efficiency, "chunk_s": 0.0,
            "gather_bandwidth": 1e12, "span_s": 0.0, "contention": 0.0,
            "compute": {"decode_s": 0.5}}
    own = hw_from_dict(data, "x", "x.toml")
    assert costs_for(spec, own, load_link(hw.link), own.engine).decode_s == 0.5
    with pytest.raises(ProfileError, match="decode_row_s"):
        hw_from_dict({**data, "compute": {"decode_row_s": -1.0}}, "x", "x.toml")


def test_steps_ended_in_place_give_the_same_run_as_through_the_heap(tmp_path, monkeypatch):
    """A decode step that ends before every other pending event is handled in place; forcing
    every step through the heap gives a byte-identical trace and the same summary."""
    config = cfg(output_tokens=12, producers=2, concurrency=3)
    requests = reqs(*[16 + 24 * i for i in range(9)])
    inline = simulate(config, requests)
    write_trace(tmp_path / "a.jsonl", inline)
    monkeypatch.setattr("pdsim.core.env.Env.take", lambda self, t: False)
    heap = simulate(config, requests)
    write_trace(tmp_path / "b.jsonl", heap)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert workload_metrics(inline) == workload_metrics(heap)
    assert inline.decode.steps > 9 and check_file(tmp_path / "a.jsonl").ok


def test_one_request_run_with_output_tokens_prints_the_serving_keys(capsys):
    """`pdsim run` of one request that decodes adds pdgpu serve's keys to the single-run
    metrics; tokens/s = its tokens over its wall time."""
    assert main(["run", "--prompt", "512", "--output-tokens", "9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode_steps"] == 8 and out["handoff_s"] > 0
    assert out["tokens_per_s"] == pytest.approx(9 / out["wall_s"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(st.integers(1, 200), min_size=1, max_size=8),
       outputs=st.lists(st.integers(0, 12), min_size=8, max_size=8),
       gaps=st.lists(st.floats(0.0, 0.05), min_size=8, max_size=8),
       producers=st.integers(1, 3), concurrency=st.one_of(st.none(), st.integers(1, 4)),
       sender=st.sampled_from(["blocking", "queued"]), mode=st.sampled_from(MODE_NAMES),
       handling=st.booleans())
def test_every_decode_step_reads_what_its_batch_holds(prompts, outputs, gaps, producers,
                                                      concurrency, sender, mode, handling):
    """Any workload (with or without the decoder's own work between steps): each step's
    batch is the requests decoding then and its KV tokens the sum of their prompt plus tokens
    decoded so far; each request takes its output - 1 steps; every request released."""
    arrivals = [sum(gaps[:i + 1]) for i in range(len(prompts))]
    requests = reqs(*prompts, outputs=outputs[:len(prompts)], arrivals=arrivals)
    costs = attrs.evolve(COSTS, decode_gap_s=0.002, land_byte_s=1e-6, admit_byte_s=1e-7) \
        if handling else COSTS
    result = simulate(cfg(costs=costs, producers=producers, concurrency=concurrency,
                          sender=sender, mode=mode), requests)
    record = result.decode
    batch = [0] * record.steps
    kv = [0] * record.steps
    for r in requests:
        first_t, first, steps = record.tokens[r.req]
        assert steps == max(r.output_tokens - 1, 0)
        for k in range(first, first + steps):
            batch[k] += 1
            kv[k] += r.prompt + k - first
    assert batch == record.batch and kv == record.kv_tokens
    assert all(b >= a for a, b in zip(record.step_end, record.step_start[1:], strict=False))
    assert sum(e.kind == "release" for e in result.events) == len(requests)
    assert result.leaked_pages == 0


def test_corrupted_spans_fail_at_their_land_and_are_fenced_at_once(tmp_path):
    """--corrupt-rate with --verify (pdgpu serve's fault kind): a corrupted span's copy runs
    out, fails when the decoder checks it and is fenced then; lives retried, nothing leaked."""
    config = cfg(output_tokens=4, concurrency=3, producers=2, sender="queued")
    requests = reqs(*[64 + 16 * i for i in range(10)])
    result = simulate(config, requests, FaultSpec(corrupt_rate=0.1, verify=True, seed=2))
    fails = {e.span: e for e in result.events if e.kind == "fail"}
    fences = {e.span: e.t for e in result.events if e.kind == "fence"}
    assert fails and all("checksum" in e.error for e in fails.values())
    assert all(fences[span] == e.t for span, e in fails.items())
    write_trace(tmp_path / "t.jsonl", result)
    assert check_file(tmp_path / "t.jsonl").ok and result.leaked_pages == 0
    assert sum(o.attempts for o in result.outcomes) > len(requests)


def test_corrupt_rate_without_verify_is_refused(capsys):
    """Unchecked corrupted bytes would be decoded: refused in one line naming both, exit 2."""
    assert main(["run", "--requests", "3", "--prompt", "256", "--corrupt-rate", "0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--corrupt-rate" in err and "--verify" in err


def test_the_decoders_own_work_between_steps_delays_the_next_step():
    """decode_gap_s after every step, admit_byte_s per KV byte of an admitted context: a
    lone request's first step starts that much after its admission, later tokens come a
    step plus a gap apart, and tokens/s falls accordingly."""
    gap, per_byte = 0.004, 1e-6
    costs = attrs.evolve(COSTS, decode_gap_s=gap, admit_byte_s=per_byte)
    result = simulate(cfg(costs=costs, output_tokens=5), reqs(64))
    stages = decode_stages(result)
    admit = times(result, "admit")["r0"]
    assert stages[0].t == pytest.approx(admit + per_byte * GEO.bytes_per_token * 64)
    for a, b in zip(stages, stages[1:], strict=False):
        assert b.t == pytest.approx(a.end + gap)
    m = workload_metrics(result)
    assert m["wall_s"] == pytest.approx(stages[-1].end)
    plain = workload_metrics(simulate(cfg(output_tokens=5), reqs(64)))
    assert m["tokens_per_s"] < plain["tokens_per_s"]


def test_landing_bytes_keeps_the_decoder_busy():
    """land_byte_s: each landed span costs the decoder its bytes' time; spans arriving
    meanwhile land together after it, so the last land (and the admission) comes later."""
    costs = attrs.evolve(COSTS, land_byte_s=1e-5)
    slow = simulate(cfg(costs=costs, output_tokens=2), reqs(256))
    plain = simulate(cfg(output_tokens=2), reqs(256))
    groups: dict[float, int] = {}
    for e in slow.events:
        if e.kind == "land":
            groups[e.t] = groups.get(e.t, 0) + 1
    at = sorted(groups)
    span = GEO.region_bytes((0, GEO.layers), (0, 32))
    assert max(groups.values()) >= 2  # some spans waited for the decoder and landed together
    assert all(b - a >= 1e-5 * span * groups[a] - 1e-12 for a, b in zip(at, at[1:],
                                                                          strict=False))
    assert times(slow, "admit")["r0"] > times(plain, "admit")["r0"] + 1e-5 * span


def test_closed_loop_default_pool_holds_c_of_the_largest_slabs(capsys):
    """--concurrency C without --pool-pages: the pool holds the C largest slabs (pdgpu
    serve's default), so C requests are never held back by the pool."""
    argv = ["run", "--requests", "64", "--prompt", "512", "--concurrency", "32",
            "--output-tokens", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pool_pages"] == 32 * 32  # 32 slabs of 512 tokens in 16-token pages
    assert out["queue_wait_p99_s"] == 0.0
    assert main(argv + ["--pool-pages", str(16 * 32)]) == 0  # 16 slabs: some wait
    assert json.loads(capsys.readouterr().out)["queue_wait_p99_s"] > 0


# -- shared host cores (profile [compute] host_cores: processor sharing) ------------------------


def _ends(cores: float, starts: list[tuple[float, float]]) -> list[float]:
    """End times of activities (start time, work alone in seconds) on `cores` shared cores."""
    from pdsim.core.cores import HostCores
    from pdsim.core.env import Env

    env = Env()
    host, ends = HostCores(env, cores), {}
    for i, (t, work) in enumerate(starts):
        env.at(t, host.start, work, lambda i: ends.__setitem__(i, env.now), i)
    env.run()
    return [ends[i] for i in range(len(starts))]


def test_processor_sharing_by_hand():
    """One core: a lone activity takes its own time; two together take twice as long; one
    joining halfway re-times the other (exact sharing, not a rate frozen at start); two
    cores run two at full speed."""
    assert _ends(1, [(0.0, 1.0)]) == [pytest.approx(1.0)]
    assert _ends(1, [(0.0, 1.0), (0.0, 1.0)]) == [pytest.approx(2.0)] * 2
    # a: 0.5 alone, then shares with b; b: 0.25 of work at half speed ends at 1.0; a then
    # has 0.25 left alone: ends at 1.25
    assert _ends(1, [(0.0, 1.0), (0.5, 0.25)]) == [pytest.approx(1.25), pytest.approx(1.0)]
    assert _ends(2, [(0.0, 1.0), (0.0, 1.0)]) == [pytest.approx(1.0)] * 2
    assert _ends(2, [(0.0, 1.0)] * 3) == [pytest.approx(1.5)] * 3


def test_a_landing_slows_the_prefill_running_then_by_hand():
    """slow_prefill adds work to every running prefill activity, re-timing its end, and to
    nothing else: a decode step beside it, or an idle host, is untouched."""
    from pdsim.core.cores import HostCores
    from pdsim.core.env import Env

    env, ends = Env(), {}
    host = HostCores(env, 2)

    def done(name):
        ends[name] = env.now

    env.at(0.0, lambda: host.start(1.0, done, "prefill", prefill=True))
    env.at(0.0, lambda: host.start(1.0, done, "decode"))
    env.at(0.5, host.slow_prefill, 0.25)
    env.at(2.0, host.slow_prefill, 0.25)  # nothing running: nothing to slow
    env.run()
    assert ends == {"prefill": pytest.approx(1.25), "decode": pytest.approx(1.0)}


def test_land_contention_slows_chunked_prefill_on_shared_cores_only():
    """With land_contention, chunk mode's chunks (each beside a landing) run longer on
    shared cores; on dedicated devices, or at 0, the run is the same as without it."""
    requests = reqs(200, 200, 200, arrivals=[0.0, 0.0, 0.0])

    def wall(costs):
        run_cfg = serving_config(cfg(costs=costs, output_tokens=8, producers=2), requests,
                                 concurrency=3)
        return workload_metrics(simulate(run_cfg, requests))["wall_s"]

    shared = attrs.evolve(COSTS, host_cores=2)
    assert wall(attrs.evolve(shared, land_contention=1e-7)) > wall(shared)
    assert wall(attrs.evolve(COSTS, land_contention=1e-7)) == wall(COSTS)


def test_land_contention_needs_host_cores():
    """A profile with land_contention but no host_cores is refused in one line naming the
    field (it would slow nothing); with host_cores it is taken."""
    data = {**load_hw_dict(), "compute": {"land_contention": 1e-9}}
    with pytest.raises(ProfileError, match="land_contention") as e:
        hw_from_dict(data, "mine", "mine.toml")
    assert len(str(e.value).splitlines()) == 1
    data["compute"]["host_cores"] = 2
    assert hw_from_dict(data, "mine", "mine.toml").engine.compute.land_contention == 1e-9


def _shared(cores):
    return cfg(costs=attrs.evolve(COSTS, host_cores=cores), output_tokens=8, stages=True)


def test_a_lone_request_on_shared_cores_runs_as_on_dedicated_devices():
    """One request never overlaps its own prefill and decode: the same events either way."""
    alone = list(simulate(cfg(output_tokens=8, stages=True), reqs(200)).trace_events())
    shared = list(simulate(_shared(1), reqs(200)).trace_events())
    assert [(e.kind, getattr(e, "name", None)) for e in shared] == \
        [(e.kind, getattr(e, "name", None)) for e in alone]
    assert [e.t for e in shared] == pytest.approx([e.t for e in alone], abs=1e-12)


def test_prefill_beside_decode_on_one_core_runs_slower_and_is_checked(tmp_path):
    """With one shared core a prefill chunk overlapping decode steps lasts longer than its
    cost alone, and the run's trace (stages merged by time) is legal."""
    requests = reqs(200, 200, 200, arrivals=[0.0, 0.0, 0.0])
    run_cfg = serving_config(_shared(1), requests, concurrency=3)
    result = simulate(run_cfg, requests)
    stages = [e for e in result.trace_events() if e.kind == "stage"]
    decodes = [s for s in stages if s.name == "decode"]
    slowed = [s for s in stages if s.name == "compute"
              and any(d.t < s.end and d.end > s.t for d in decodes)]
    assert slowed and all(s.end - s.t > COSTS.compute_s((0, 32)) for s in slowed)
    write_trace(str(tmp_path / "t.jsonl"), result)
    check_file(str(tmp_path / "t.jsonl"))
    dedicated = simulate(attrs.evolve(run_cfg, costs=COSTS), requests)
    assert workload_metrics(result)["wall_s"] > workload_metrics(dedicated)["wall_s"]


@pytest.mark.parametrize("value", [0, 0.5, -1, "two", True, float("inf")])
def test_bad_host_cores_names_the_field(value):
    """host_cores must be a finite number >= 1: else one line naming the field."""
    data = {**load_hw_dict(), "compute": {"host_cores": value}}
    with pytest.raises(ProfileError, match="host_cores") as e:
        hw_from_dict(data, "mine", "mine.toml")
    assert len(str(e.value).splitlines()) == 1


def load_hw_dict() -> dict:
    """a100-pcie's datasheet with seed-eager's software figures: a calibrated profile's form."""
    import tomllib

    from pdsim.core.engines import ENGINES_DIR
    from pdsim.core.profiles import HW_DIR

    seed = tomllib.loads((ENGINES_DIR / "seed-eager.toml").read_text())
    software = {k: v for k, v in seed.items() if k not in ("name", "source", "cost_model")}
    software["gather_bandwidth"] = 800e9
    del software["gather_efficiency"]
    return tomllib.loads((HW_DIR / "a100-pcie.toml").read_text()) | software


def test_a_profile_with_bad_host_cores_is_one_line_exit_2(tmp_path, capsys):
    """`pdsim run --hw FILE` with host_cores = 0: exit 2, one line naming the field."""
    import tomllib

    from pdsim.core.profiles import HW_DIR

    text = (HW_DIR / "a100-pcie.toml").read_text()
    assert "[compute]" not in text and "host_cores" not in tomllib.loads(text)
    path = tmp_path / "mine.toml"
    path.write_text(text + "\n[compute]\nhost_cores = 0\n")
    assert main(["run", "--requests", "2", "--prompt", "256", "--hw", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "host_cores" in err and "Traceback" not in err


def test_quiet_decode_steps_match_steps_run_one_by_one(monkeypatch):
    """Steps the decoder runs in its tight loop have the times, batches and KV of steps run
    one at a time, and the run's events are the same."""
    from pdsim.core.decoder import Decoder

    requests = reqs(64, 200, 96, 300, 40, outputs=[40, 25, 60, 8, 33],
                    arrivals=[0.0, 0.05, 0.3, 0.31, 0.9])
    run_cfg = cfg(costs=attrs.evolve(COSTS, decode_gap_s=2e-4), stages=True)
    quiet = []
    tight = Decoder._quiet_steps

    def counted(self):
        before = self.next_step
        tight(self)
        quiet.append(self.next_step - before)

    monkeypatch.setattr(Decoder, "_quiet_steps", counted)
    fast = simulate(run_cfg, requests)
    monkeypatch.setattr(Decoder, "_quiet_steps", lambda self: None)
    one_by_one = simulate(run_cfg, requests)
    assert sum(quiet) > fast.decode.steps // 2  # most steps ran in the tight loop
    assert fast.decode == one_by_one.decode
    assert fast.events == one_by_one.events and fast.steps == one_by_one.steps


def test_decode_record_runs_have_one_form():
    """Steps added one by one or as one run give the same record, batches, KV and mean."""
    from pdsim.core.decoder import DecodeRecord

    one_by_one, as_runs = DecodeRecord(), DecodeRecord()
    for kv in (100, 103, 106):
        one_by_one.add_run(1, 3, kv, "a")
    one_by_one.add_run(1, 2, 50, "a")  # a request finished: a new run
    one_by_one.add_run(1, 2, 52, "b")  # another label: a new run
    as_runs.add_run(3, 3, 100, "a")
    as_runs.add_run(1, 2, 50, "a")
    as_runs.add_run(1, 2, 52, "b")
    assert one_by_one == as_runs and len(as_runs.runs) == 3
    assert as_runs.batch == [3, 3, 3, 2, 2] and as_runs.kv_tokens == [100, 103, 106, 50, 52]
    assert as_runs.label == ["a", "a", "a", "a", "b"]
    assert as_runs.batch_mean() == 13 / 5 and DecodeRecord().batch_mean() is None


def test_inter_token_gaps_count_each_requests_steps_once():
    """The gap values and counts equal a request-by-request count: its first gap, then each
    later decode step it took part in (staggered arrivals, mixed outputs)."""
    prompts = [40, 96, 64, 128, 32, 80]
    result = simulate(cfg(), reqs(*prompts, outputs=[1, 5, 9, 3, 12, 7],
                                  arrivals=[0.0, 0.001, 0.004, 0.02, 0.021, 0.05]))
    ok = [f"r{i}" for i in range(len(prompts))]
    values, counts = inter_token_gaps(result, ok)
    record = result.decode
    expected = []
    for req in ok:
        first_t, first, steps = record.tokens[req]
        if steps:
            expected.append(record.step_end[first] - first_t)
            expected += [record.step_end[k] - record.step_start[k]
                         for k in range(first + 1, first + steps)]
    assert len(expected) > len(ok)  # several requests decoded several steps
    assert sorted(np.repeat(values, counts).tolist()) == sorted(expected)
