"""Streamed runs (pdsim/core/stream.py): the same metrics as a run that keeps everything, in
memory that follows the requests in flight; the quantile sketch's error bound; the lean
span-id set."""

import json

import attrs
import numpy as np
import pytest

from pdref.fast_monitor import FastMonitor
from pdref.span_ids import UsedSpanIds
from pdsim.cli import main
from pdsim.core.config import RequestSpec, SimConfig
from pdsim.core.metrics import workload_metrics
from pdsim.core.play import simulate
from pdsim.core.quantiles import ACCURACY, Quantiles
from pdsim.core.sim import Sim, make_header
from pdsim.core.stream import RunStream
from pdsim.options import Parser, add_model_options, base_config
from pdsim.views import progress as progress_view
from pdsim.views.report import ResultsStream, request_results


def small_cfg(**kw) -> SimConfig:
    parser = Parser()
    add_model_options(parser)
    base = dict(mode="chunk", chunk=256, pool_pages=4096, output_tokens=9)
    base.update(kw)
    return attrs.evolve(base_config(parser.parse_args(["--hw", "h200"])), **base)


def workload(n: int, seed: int = 1, rate: float = 40.0) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    prompts = rng.integers(64, 2048, n)
    outputs = rng.integers(0, 12, n)
    return [RequestSpec(f"r{i}", float(t[i]), int(prompts[i]), 0, int(outputs[i]))
            for i in range(n)]


@pytest.mark.parametrize("kw", [dict(), dict(producers=2, mode="layer"),
                                dict(concurrency=3, sender="queued", source_pages=256),
                                dict(mode="whole", stages=False)])
def test_streamed_run_has_the_kept_runs_metrics(kw):
    """Drained every few hundred events, a run reports exactly the metrics of the same run
    kept whole (open and closed loop, several producers, every mode)."""
    cfg, requests = small_cfg(**kw), workload(100)
    if cfg.concurrency is not None:
        requests = [RequestSpec(r.req, 0.0, r.prompt, 0, r.output_tokens) for r in requests]
    kept = workload_metrics(simulate(cfg, requests))
    streamed = workload_metrics(simulate(cfg, iter(requests), stream=RunStream(cfg, every=300)))
    assert streamed == kept
    assert list(streamed) == list(kept)


def test_streamed_results_rows_are_the_kept_ones(tmp_path):
    """`--results` rows written as requests end hold the kept run's rows (in end order)."""
    cfg, requests = small_cfg(), workload(60)
    path = tmp_path / "rows.jsonl"
    with ResultsStream(str(path)) as results:
        simulate(cfg, requests, stream=RunStream(cfg, on_ok=results.write, every=200))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    kept = request_results(simulate(cfg, requests))
    assert sorted(rows, key=lambda r: r["req"]) == sorted(kept, key=lambda r: r["req"])


def test_streamed_run_forgets_what_ended():
    """After a streamed run nothing per request is left: the monitor's lives, the decode
    record's tokens and steps, the stream's facts, the span ids (one range)."""
    cfg = small_cfg()
    sim = Sim(cfg, workload(200), RunStream(cfg, every=100))
    sim.run()
    assert not sim.monitor.mirror.requests and not sim.decoder.record.tokens
    assert not sim.decoder.record.step_end and not sim.stream.facts and not sim.events
    assert not sim.decoder.admitted and not sim.decoder.first_token
    assert sim.monitor.mirror.spans_used.ranges == 1


def test_stream_refuses_faults():
    """A run with faults keeps its requests: asking to stream it is refused."""
    from pdsim.core.faults import FaultSpec

    cfg = small_cfg()
    with pytest.raises(ValueError, match="faults"):
        simulate(cfg, workload(3), FaultSpec(fail_rate=0.5), stream=RunStream(cfg))


def test_sketch_percentiles_within_the_bound_of_exact_ones():
    """10,000 latencies (log-normal, spread over 4 decades) and weighted ones: each sketched
    percentile is within ACCURACY (relative) of the exact one."""
    rng = np.random.default_rng(7)
    values = rng.lognormal(-3, 2, 10_000)
    weights = rng.integers(0, 30, 10_000)
    for counts in (np.ones(10_000, dtype=np.int64), weights):
        exact, sketch = Quantiles(), Quantiles(exact_limit=0)
        exact.extend(values, counts)
        sketch.extend(values, counts)
        assert exact.exact and not sketch.exact
        for q in (1, 50, 90, 99, 99.9, 100):
            want, got = exact.percentile(q), sketch.percentile(q)
            assert abs(got - want) <= ACCURACY * want
        want, got = exact.interpolated(99), sketch.interpolated(99)
        assert abs(got - want) <= ACCURACY * want


def test_quantiles_exact_until_the_limit():
    """Below the limit the answers are numpy's: nearest rank and interpolated percentile and
    mean of the values as added one by one; zero and negative values are kept apart."""
    values = [0.5, -2.0, 0.0, 3.0, 1e-3, 7.0, 0.0]
    q = Quantiles(exact_limit=3)
    for v in values[:3]:
        q.add(v)
    assert q.exact and q.mean() == float(np.mean(values[:3]))
    assert q.interpolated(99) == float(np.percentile(values[:3], 99))
    for v in values[3:]:
        q.add(v)
    assert not q.exact and q.count == len(values)
    ordered = sorted(values)
    for rank, want in enumerate(ordered, 1):
        got = q.percentile(100 * (rank - 0.5) / len(values))
        assert got == want or abs(got - want) <= ACCURACY * abs(want)
    assert Quantiles().percentile(50) is None and Quantiles().mean() is None


def test_used_span_ids_ranges_and_others():
    """Ids given in any order answer membership as a set would; a counter's ids are one
    range; other ids keep their owner."""
    rng = np.random.default_rng(3)
    ids = UsedSpanIds()
    seen = set()
    for span in rng.permutation(60).tolist()[:40]:
        ids[span] = "r"
        seen.add(span)
    ids["s-1"] = "r9"
    assert all((span in ids) == (span in seen) for span in range(-2, 64))
    assert "s-1" in ids and "s-2" not in ids and len(ids) == 41
    counter = UsedSpanIds()
    for span in range(1000):
        counter[span] = f"r{span // 7}"
    assert counter.ranges == 1 and 999 in counter and 1000 not in counter
    assert dict(UsedSpanIds([(5, "a"), ("x", "b")]).items()) == {5: None, "x": "b"}


def test_lean_monitor_refuses_a_reused_span_id():
    """A lean monitor keeps no span owners yet refuses an id used before, as the
    specification does (REQ-1)."""
    from pdref import events as ev
    from pdref.violations import Violation

    cfg = small_cfg()
    monitor = FastMonitor(make_header(cfg), lean=True)
    monitor.reserve(0.0, "a", 64, 0)
    monitor.emit(ev.Computed(0.1, "a", (0, cfg.geometry.layers), (0, 16)))
    nbytes = cfg.geometry.bytes_per_token_layer * cfg.geometry.layers * 16
    monitor.emit(ev.Issue(0.2, "a", 0, (0, cfg.geometry.layers), (0, 16), nbytes))
    with pytest.raises(Violation, match="REQ-1"):
        monitor.emit(ev.Issue(0.3, "a", 0, (0, cfg.geometry.layers), (0, 16), nbytes))


def test_cli_run_streams_and_prints_the_same(tmp_path, capsys):
    """`pdsim run` of a workload (streamed) prints what the same run with a trace (kept)
    prints, but for nothing."""
    argv = ["run", "--hw", "h200", "--requests", "40", "--rate", "30", "--prompt-range",
            "64:1024", "--output-tokens", "4", "--json"]
    assert main(argv) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert main([*argv, "--trace", str(tmp_path / "t.jsonl")]) == 0
    assert json.loads(capsys.readouterr().out) == streamed


def test_progress_lines_off_a_terminal(monkeypatch, capsys):
    """Off a terminal, once the run has taken DELAY_S, a line every EVERY_S seconds says the
    requests simulated of all and the simulated time; the last one counts every request."""
    monkeypatch.setattr(progress_view, "DELAY_S", 0.0)
    monkeypatch.setattr(progress_view, "EVERY_S", 0.0)
    cfg = small_cfg()
    with progress_view.RunProgress(120, terminal=False) as progress:
        result = simulate(cfg, workload(120), stream=RunStream(cfg, progress=progress,
                                                              every=500))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) > 2 and all(line.startswith("pdsim run: ") for line in lines)
    assert lines[-1].startswith("pdsim run: 120/120 requests simulated, ")
    assert f"{result.running.makespan:,.0f} s simulated" in lines[-1]


def test_short_run_and_no_progress_say_nothing(capsys):
    """A run shorter than DELAY_S prints no progress, and --no-progress none at all."""
    argv = ["run", "--hw", "h200", "--requests", "30", "--rate", "30", "--output-tokens", "2",
            "--prompt", "256", "--json"]
    assert main(argv) == 0 and capsys.readouterr().err == ""
    assert main([*argv, "--no-progress"]) == 0 and capsys.readouterr().err == ""


def test_sweep_workload_point_is_the_run_of_that_workload(tmp_path, capsys):
    """A `pdsim sweep --requests --rate` row holds what `pdsim run` reports for the same
    workload (prompt, arrivals, chunk, mode, outputs, pool of 16)."""
    sweep_json = tmp_path / "s.json"
    assert main(["sweep", "--hw", "h200", "--modes", "layer", "--prompts", "768", "--chunks",
                 "256", "--requests", "120", "--rate", "25", "--output-tokens", "5", "--seed",
                 "3", "--jobs", "1", "--quiet", "--json", str(sweep_json)]) == 0
    row = json.loads(sweep_json.read_text())["rows"][0]
    assert main(["run", "--hw", "h200", "--mode", "layer", "--prompt", "768", "--chunk", "256",
                 "--requests", "120", "--rate", "25", "--output-tokens", "5", "--seed", "3",
                 "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    for key in ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "tokens_per_s", "makespan_s",
                "pool_occupancy_mean", "requests"):
        assert row[key] == run[key], key


@pytest.mark.parametrize("extra, words", [
    (["--requests", "10"], "--requests and --rate go together"),
    (["--rate", "3"], "--requests and --rate go together"),
    (["--output-tokens", "3"], "--output-tokens needs --requests"),
    (["--requests", "0", "--rate", "3"], "--requests must be > 0"),
    (["--requests", "5", "--rate", "3", "--png", "x.png"], "--png plots one-request"),
])
def test_sweep_workload_bad_input(capsys, extra, words):
    """Workload points' options refused by name, one line, exit 2."""
    assert main(["sweep", "--hw", "h200", "--chunks", "256", "--quiet", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
