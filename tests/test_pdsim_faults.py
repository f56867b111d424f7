"""pdsim fault injection: failed, stalled and timed-out spans, cancellations, dead producers."""

import io
import json

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdref.check import check_lines
from pdref.events import event_to_json, header_to_json
from pdref.models import load_model
from pdref.monitor import Monitor
from pdsim.cli import main
from pdsim.core.config import SimConfig
from pdsim.core.costs import costs_for, sim_geometry
from pdsim.core.engines import load_engine
from pdsim.core.faults import FaultSpec, Kill
from pdsim.core.metrics import workload_metrics
from pdsim.core.play import simulate
from pdsim.core.profiles import load_hw, load_link
from pdsim.core.workload import WorkloadSpec, build_requests


def slow_link_config(mode="chunk", producers=2, pool_pages=None, **changes) -> SimConfig:
    """qwen3-0.6b on a100-pcie with a link 20x slower: spans are in flight most of the time."""
    spec, hw = load_model("qwen3-0.6b"), load_hw("a100-pcie")
    seed = load_engine("seed-eager")
    costs = costs_for(spec, hw, load_link(hw.link), seed).scaled(bandwidth=0.05)
    cfg = SimConfig(sim_geometry(spec), costs, mode, 128, max_pending=2,
                    pool_pages=pool_pages or 4 * 64, producers=producers, output_tokens=8)
    return attrs.evolve(cfg, **changes)


def workload(count=12, seed=3, rate=20.0, prompts=(256, 1024)):
    spec = WorkloadSpec(requests=count, prompt_range=prompts, rate=rate, seed=seed)
    return build_requests(spec, 16)


def checked(result):
    """The run serialized as a trace and checked by pdref, as `pdref check` would."""
    lines = [json.dumps(header_to_json(result.header))]
    lines += [json.dumps(event_to_json(e)) for e in result.events]
    return check_lines(io.BytesIO(("\n".join(lines) + "\n").encode()))


def assert_sound(result) -> None:
    """Legal trace, nothing leaked, one outcome per request, and the summary agrees."""
    verdict = checked(result)
    assert verdict.ok, verdict.text()
    assert result.leaked_pages == 0
    assert [o.req for o in result.outcomes] == [r.req for r in result.requests]
    m = workload_metrics(result)
    assert m["ok"] + m["cancelled"] + m["failed"] == len(result.requests) == m["requests"]
    released = sum(e.kind == "release" for e in result.events)
    assert m["ok"] == released
    assert m["lives"] == sum(e.kind == "reserve" for e in result.events)
    fences = {e.span: e.t for e in result.events if e.kind == "fence"}
    for e in result.events:  # no stage of a writer starts after it stopped
        assert e.kind != "stage" or e.span not in fences or e.t <= fences[e.span]


KINDS = {
    "fail": (FaultSpec(fail_rate=0.1, seed=1), "copy failed"),
    "stall": (FaultSpec(stall_rate=0.1, span_timeout=0.05, seed=1), "stalled past its deadline"),
    "timeout": (FaultSpec(span_timeout=0.004, seed=1), "deadline passed"),
    "cancel": (FaultSpec(cancel_rate=0.5, seed=1), "cancelled"),
    "kill": (FaultSpec(kills=(Kill(1, 0.3),), heartbeat_timeout=0.05), "producer p1 lost"),
    "kill+restart": (FaultSpec(kills=(Kill(0, 0.1), Kill(0, 0.5)), heartbeat_timeout=0.05,
                               restart_producers=True, restart_delay=0.1), "producer p0 lost"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_fault_kind_gives_a_legal_trace_without_leaks(kind):
    """Every fault kind on a short workload: the fault shows in the trace, the trace passes
    pdref check, no page leaks, the outcomes add up."""
    faults, error = KINDS[kind]
    result = simulate(slow_link_config(), workload(), faults)
    assert_sound(result)
    reasons = {getattr(e, "error", None) or getattr(e, "reason", None) for e in result.events}
    assert error in reasons


def test_all_faults_at_once_on_every_mode():
    """Every fault kind together, in each mode: legal, no leak, outcomes add up."""
    faults = FaultSpec(fail_rate=0.05, stall_rate=0.05, cancel_rate=0.3, span_timeout=0.1,
                       kills=(Kill(1, 0.15), Kill(1, 0.6)), heartbeat_timeout=0.05,
                       restart_producers=True, restart_delay=0.05, seed=7)
    for mode in ("whole", "chunk", "layer"):
        assert_sound(simulate(slow_link_config(mode), workload(16), faults))


def pool_history(result):
    """(event, free page ids after it) for every event, replayed through a pdref Monitor."""
    monitor = Monitor(result.header)
    out = []
    for e in result.events:
        monitor.emit(e)
        out.append((e, set(monitor.free_page_ids())))
    return out


def test_cancelled_pages_come_back_at_the_last_fence_not_at_the_abort():
    """A cancel with spans in flight quarantines the slab: its pages are not free after the
    abort, come back at the fence of its last writer, and a waiting reserve takes them then."""
    cfg = slow_link_config(producers=1, pool_pages=64)  # one 1024-token slab at a time
    requests = workload(10, prompts=(1024, 1024))
    result = simulate(cfg, requests, FaultSpec(cancel_rate=0.6, seed=2))
    assert_sound(result)
    history = pool_history(result)
    slabs, cases = {}, 0
    for i, (e, free) in enumerate(history):
        if e.kind == "reserve":
            slabs[e.req] = set(e.pages)
        if e.kind != "abort" or e.reason != "cancelled":
            continue
        pages = slabs[e.req]
        writers = [h for h in history[i + 1:] if h[0].kind == "fence" and h[0].req == e.req]
        if not writers:
            assert pages <= free  # no span in flight: back at the abort
            continue
        assert not pages & free  # quarantined while a cancelled writer may still write
        last = writers[-1][0]
        j = next(k for k, h in enumerate(history) if h[0] is last)
        assert pages <= history[j][1] | _taken_at(history, j)  # back at the last fence
        later = [h[0] for h in history[j:] if h[0].kind == "reserve" and set(h[0].pages) & pages]
        assert last.t > e.t
        if later:  # the next slab over these pages: reserved at the fence or after, and
            assert later[0].t >= last.t  # with a pool of one slab, right at the fence
            cases += later[0].t == last.t
    assert cases >= 1


def _taken_at(history, j):
    """Pages reserved by events at the same t right after event j (dispatch at the fence)."""
    t = history[j][0].t
    return {p for e, _ in history[j + 1:] if e.t == t and e.kind == "reserve" for p in e.pages}


def test_failed_life_is_fenced_then_aborted_then_retried():
    """fail -> fence (writer stopped) -> reuse, abort -> a new life of the same request."""
    result = simulate(slow_link_config(), workload(), FaultSpec(fail_rate=0.15, seed=4))
    assert_sound(result)
    events = list(result.events)
    retried = 0
    for i, e in enumerate(events):
        if e.kind != "fail":
            continue
        fence = next(f for f in events[i:] if f.kind == "fence" and f.span == e.span)
        abort = next(a for a in events[i:] if a.kind == "abort" and a.req == e.req)
        assert events.index(fence) < events.index(abort) and fence.t <= abort.t
        again = [r for r in events[events.index(abort):] if r.kind == "reserve"
                 and r.req == e.req]
        retried += bool(again)
    assert retried >= 1
    attempts = {o.req: o.attempts for o in result.outcomes}
    lives = {}
    for e in events:
        if e.kind == "reserve":
            lives[e.req] = lives.get(e.req, 0) + 1
    assert attempts == {r.req: lives.get(r.req, 0) for r in result.requests}


def test_max_attempts_bounds_the_retries():
    """With --max-attempts 1 a failed life is not retried: the request is failed."""
    result = simulate(slow_link_config(), workload(),
                      FaultSpec(fail_rate=0.3, max_attempts=1, seed=4))
    assert_sound(result)
    failed = [o for o in result.outcomes if o.status == "failed"]
    assert failed and all(o.attempts == 1 for o in result.outcomes)


def test_stalled_span_fails_at_its_deadline():
    """A stalled span fails exactly --span-timeout after its issue; fenced after the ack."""
    faults = FaultSpec(stall_rate=0.2, span_timeout=0.03, fence_delay=0.002, seed=5)
    result = simulate(slow_link_config(), workload(), faults)
    assert_sound(result)
    issued = {e.span: e.t for e in result.events if e.kind == "issue"}
    fences = {e.span: e.t for e in result.events if e.kind == "fence"}
    stalls = [e for e in result.events if e.kind == "fail" and e.error.startswith("stalled")]
    assert stalls
    for e in stalls:
        assert e.t == pytest.approx(issued[e.span] + 0.03)
        assert fences[e.span] >= e.t + 0.002 - 1e-12


def test_killed_producer_is_detected_and_its_requests_retried_elsewhere():
    """Killed at T: nothing of it lands after T; at T + heartbeat its spans fail and are
    fenced; its lives are retried on the survivor; no request is sent to it after."""
    kill_t, beat = 0.3, 0.05
    result = simulate(slow_link_config(), workload(),
                      FaultSpec(kills=(Kill(1, kill_t),), heartbeat_timeout=beat))
    assert_sound(result)
    owner, producer_of = {}, {}
    for e in result.events:
        if e.kind == "reserve":
            producer_of[e.req] = e.producer
        if e.kind == "issue":
            owner[e.span] = producer_of[e.req]
        if e.kind == "land" and owner[e.span] == "p1":
            assert e.t <= kill_t
        if e.kind == "reserve" and e.t > kill_t + beat:
            assert e.producer == "p0"
    lost = [e for e in result.events if getattr(e, "reason", None) == "producer p1 lost"]
    assert lost and all(e.t == pytest.approx(kill_t + beat) for e in lost)
    failed = [e for e in result.events if e.kind == "fail"]
    fenced = {e.span: e.t for e in result.events if e.kind == "fence"}
    assert failed and all(e.error == "producer p1 lost" and fenced[e.span] == e.t
                          == pytest.approx(kill_t + beat) for e in failed)
    assert all(o.status == "ok" for o in result.outcomes)


def test_with_every_producer_dead_the_rest_fail():
    """Both producers killed, no restart: the requests not done are failed, nothing leaks."""
    faults = FaultSpec(kills=(Kill(0, 0.3), Kill(1, 0.35)), heartbeat_timeout=0.05)
    result = simulate(slow_link_config(), workload(20), faults)
    assert_sound(result)
    statuses = {o.status for o in result.outcomes}
    assert statuses == {"ok", "failed"}
    assert all(e.t <= 0.4 + 1e-9 for e in result.events if e.kind == "reserve")
    assert any(o.reason and "no producer left" in o.reason for o in result.outcomes)


def test_restarted_producer_takes_requests_again():
    """--restart-producers: the dead producer rejoins and is reserved for again."""
    faults = FaultSpec(kills=(Kill(1, 0.1),), heartbeat_timeout=0.05, restart_producers=True,
                       restart_delay=0.1)
    result = simulate(slow_link_config(), workload(30, rate=40.0), faults)
    assert_sound(result)
    assert any(e.kind == "reserve" and e.producer == "p1" and e.t >= 0.25
               for e in result.events)


def test_same_seed_same_trace_other_seed_other_trace():
    """Fault draws are seeded: one seed gives one trace."""
    cfg, reqs = slow_link_config(), workload()

    def run(seed):
        return simulate(cfg, reqs, FaultSpec(fail_rate=0.1, cancel_rate=0.3, seed=seed)).events

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_no_fault_drawn_gives_the_fault_free_schedule():
    """The fault machinery with nothing going wrong (a deadline never reached) plays exactly
    the fault-free run."""
    cfg, reqs = slow_link_config(), workload()
    plain = simulate(cfg, reqs)
    faulty = simulate(cfg, reqs, FaultSpec(span_timeout=1e6))
    assert faulty.events == plain.events
    assert all(o.status == "ok" for o in faulty.outcomes)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), fail=st.floats(0, 0.4), stall=st.floats(0, 0.3),
       cancel=st.floats(0, 1), timeout=st.sampled_from([1e6, 0.005, 0.05]),
       kill=st.one_of(st.none(), st.tuples(st.integers(0, 1), st.floats(0, 0.4))),
       restart=st.booleans(), mode=st.sampled_from(["whole", "chunk", "layer"]),
       pending=st.integers(1, 3), attempts=st.integers(1, 3))
def test_every_faulty_trace_is_legal_and_leaks_nothing(seed, fail, stall, cancel, timeout,
                                                       kill, restart, mode, pending,
                                                       attempts):
    """Over seeds, rates, deadlines, kills and modes: legal trace, nothing leaks."""
    faults = FaultSpec(fail, stall if timeout < 1 else 0.0, cancel,
                       () if kill is None else (Kill(*kill),), timeout, 0.03,
                       max_attempts=attempts, restart_producers=restart, restart_delay=0.02,
                       seed=seed)
    cfg = slow_link_config(mode, max_pending=pending, pool_pages=100)
    assert_sound(simulate(cfg, workload(8, seed=seed % 97), faults))


@pytest.mark.parametrize("argv, option", [
    (["--fail-rate", "1.5"], "--fail-rate"),
    (["--stall-rate", "-0.1", "--span-timeout", "1"], "--stall-rate"),
    (["--cancel-rate", "nan"], "--cancel-rate"),
    (["--span-timeout", "0"], "--span-timeout"),
    (["--span-timeout", "-2"], "--span-timeout"),
    (["--stall-rate", "0.1"], "--span-timeout"),
    (["--kill-producer", "2@1", "--producers", "2"], "--kill-producer"),
    (["--kill-producer", "0@-1"], "--kill-producer"),
    (["--kill-producer", "zero@1"], "--kill-producer"),
    (["--kill-producer", "0"], "--kill-producer"),
    (["--max-attempts", "0", "--fail-rate", "0.1"], "--max-attempts"),
    (["--heartbeat-timeout", "0", "--kill-producer", "0@1"], "--heartbeat-timeout"),
])
def test_bad_fault_options_exit_2_with_one_line(tmp_path, capsys, argv, option):
    """Rates outside [0, 1], bad kills, a timeout <= 0: one line naming the option, exit 2,
    no trace written."""
    trace = tmp_path / "t.jsonl"
    assert main(["run", "--prompt", "512", "--trace", str(trace), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err
    assert not trace.exists()


def test_run_command_with_faults_prints_outcomes_and_writes_a_legal_trace(tmp_path, capsys):
    """`pdsim run` with fault options: outcome counts and leaked_pages; the trace is legal."""
    trace = tmp_path / "f.jsonl"
    argv = ["run", "--json", "--requests", "20", "--rate", "20", "--prompt-range", "256:1024",
            "--producers", "2", "--bandwidth-scale", "0.05", "--fail-rate", "0.05",
            "--cancel-rate", "0.3", "--kill-producer", "1@0.3", "--seed", "3",
            "--trace", str(trace)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] + out["cancelled"] + out["failed"] == out["requests"] == 20
    assert out["leaked_pages"] == 0 and out["cancelled"] >= 1
    assert check_lines(trace.open("rb")).ok


def test_results_file_has_one_line_per_request_matching_the_summary(tmp_path, capsys):
    """`--results`: one line per request; statuses, attempts and TTFTs agree with the summary
    and the trace."""
    results, trace = tmp_path / "r.jsonl", tmp_path / "t.jsonl"
    argv = ["run", "--json", "--requests", "16", "--rate", "20", "--prompt-range", "256:1024",
            "--producers", "2", "--bandwidth-scale", "0.05", "--fail-rate", "0.08",
            "--cancel-rate", "0.3", "--seed", "5", "--results", str(results),
            "--trace", str(trace)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["req"] for r in rows] == [f"r{i}" for i in range(16)]
    for status in ("ok", "cancelled", "failed"):
        assert sum(r["status"] == status for r in rows) == summary[status]
    assert sum(r["attempts"] for r in rows) == summary["lives"]
    ttfts = sorted(r["ttft_s"] for r in rows if r["status"] == "ok")
    assert all(r["ttft_s"] is None for r in rows if r["status"] != "ok")
    mid = len(ttfts) // 2
    median = ttfts[mid] if len(ttfts) % 2 else (ttfts[mid - 1] + ttfts[mid]) / 2
    assert median == pytest.approx(summary["ttft_p50_s"])
    assert all(r["e2e_s"] >= (r["ttft_s"] or 0) >= 0 for r in rows)


@pytest.mark.parametrize("mode", ["chunk", "layer", "whole"])
def test_a_run_checked_by_the_pure_monitor_is_the_same_run(monkeypatch, mode):
    """pdsim's FastMonitor and pdref's pure Monitor drive a faulty run (fails, stalls,
    cancellations, a kill and restart) to the same events, outcomes and leaked pages."""
    import pdsim.core.sim as sim_module

    cfg = slow_link_config(mode)
    faults = FaultSpec(fail_rate=0.1, stall_rate=0.05, cancel_rate=0.2, span_timeout=0.5,
                       kills=(Kill(1, 0.2),), restart_producers=True, restart_delay=0.1,
                       seed=5)
    fast = simulate(cfg, workload(count=20), faults)
    monkeypatch.setattr(sim_module, "FastMonitor", Monitor)
    pure = simulate(cfg, workload(count=20), faults)
    assert {"fail", "fence", "abort"} <= {e.kind for e in pure.protocol}  # faults happened
    assert fast.events == pure.events and fast.outcomes == pure.outcomes
    assert fast.leaked_pages == pure.leaked_pages == 0
