"""bench/multiturn.py: its workload is pdsim's sessions, its figures agree with the server's
own trace, and bad options are refused (a tiny run over `pdgpu serve --http`)."""

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import multiturn, multiturn_sim  # noqa: E402
from pdsim.core.sessions import SessionSpec, SessionWorkload  # noqa: E402

TINY = ["--model", "tiny", "--sessions", "3", "--turns", "2", "--system-prompt", "80",
        "--turn-tokens", "8:20", "--output-tokens", "3", "--think", "0.2", "--rate", "20",
        "--chunk", "32"]


@pytest.mark.parametrize("option, value, says", [
    ("--sessions", "0", "--sessions must be >= 1"),
    ("--turn-tokens", "9:4", "--turn-tokens must be A:B"),
    ("--think", "-1", "--think must be >= 0"),
    ("--output-tokens", "0", "--output-tokens must be >= 1"),
    ("--cache", "sometimes", "--cache must be distinct settings"),
    ("--cache", "off,off", "--cache must be distinct settings"),
    ("--trace-dir", "/nonexistent/folder", "--trace-dir: /nonexistent/folder is not an"),
])
def test_a_bad_option_is_refused_with_exit_2(capsys, option, value, says):
    """A bad option: exit 2 with a line naming it, before any server starts."""
    with pytest.raises(SystemExit) as stop:
        multiturn.main([*TINY, option, value])
    assert stop.value.code == 2
    assert says in capsys.readouterr().err


def test_the_sessions_are_pdsims_workload():
    """Lengths, think times and starts are pdsim's for the same spec; each prompt is the one
    before, its answer and new user tokens, all after the shared system prompt."""
    spec = SessionSpec(4, 3, 50, (5, 30), (7, 7), 1.5, 2.0, 0.0, 11)
    system, sessions = multiturn.build_sessions(spec, vocab=97)
    work = SessionWorkload(spec)
    turns = {t.req: t for s in sessions for t in s.turns}
    assert sorted(turns) == sorted(r.req for r in work.all_turns())
    for r in work.all_turns():
        assert turns[r.req].prompt == r.prompt and turns[r.req].output == r.output_tokens
    thinks = {turn.req: think for think, turn in work.followups.values()}
    assert sorted(s.start for s in sessions) == [r.arrival for r in work]
    for session in sessions:
        history = len(system)
        for turn in session.turns:
            assert turn.prompt == history + len(turn.user)
            assert turn.think_s == thinks.get(turn.req, 0.0)
            assert all(0 <= t < 97 for t in turn.user)
            history = turn.prompt + turn.output
    assert len(system) == 50


# The tests on `tiny_run` get the timeout of two whole `pdgpu serve --http` lives (its setup
# counts against the first of them): a hang guard, not a clock. Each life is CPU work
# (python, torch imported twice, the models) a loaded machine stretches: 64 s at load 15,
# 25 s of it before the port is printed (2026-12-05).
TWO_SERVERS = pytest.mark.timeout(360)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multiturn")
    out = folder / "report.json"
    stdout = sys.stdout
    with out.open("w") as sys.stdout:
        code = multiturn.main([*TINY, "--trace-dir", str(folder), "--json"])
    sys.stdout = stdout
    return code, json.loads(out.read_text()), folder


@TWO_SERVERS
def test_a_tiny_run_serves_every_turn_and_agrees_with_the_trace(tiny_run):
    """Every turn answered in full; the prompts the server reserved are the bench's, and the
    bytes handed off are the K/V of every prompt token the decoder did not hold already."""
    code, report, folder = tiny_run
    assert code == 0
    for run in report["runs"]:
        assert run["requests"] == run["ok"] == run["server_ok"] == 6 and run["errors"] == 0
        assert run["output_tokens"] == 6 * 3 and run["leaked_pages"] == 0
        header, *events = [json.loads(line) for line in
                           (folder / f"{run['setting']}.jsonl").read_text().splitlines()]
        reserves = [e for e in events if e["kind"] == "reserve"]
        assert Counter(e["prompt"] for e in reserves) == Counter(t["prompt"] for t in run["turns"])
        g = header["geometry"]
        per_token = 2 * g["layers"] * g["kv_heads"] * g["head_dim"] * g["dtype_bytes"]
        crossed = sum(e["prompt"] - e["prefix"] for e in reserves)
        assert run["bytes_handed_off"] == crossed * per_token > 0


@TWO_SERVERS
def test_a_tiny_run_keeps_think_times_and_consistent_figures(tiny_run):
    """A turn is sent no sooner than its think time after the previous answer's last token;
    TTFT p50 <= p99; tokens/s is the output over the run's wall time."""
    _, report, _ = tiny_run
    for run in report["runs"]:
        by_req = {t["req"]: t for t in run["turns"]}
        for req, turn in by_req.items():
            session, k = req[1:].split("t")
            if int(k) > 0:
                before = by_req[f"s{session}t{int(k) - 1}"]
                assert turn["sent"] >= before["end"]
                assert turn["prompt"] > before["prompt"] + len(before["tokens"])
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
        assert run["tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])


@TWO_SERVERS
def test_the_cache_changes_no_answer_and_counts_what_it_skipped(tiny_run):
    """With the cache the answers are the uncached run's; its hit rate is the cached tokens
    over the prompt tokens, the usages' cached tokens sum to the hits, the trace's producer
    hits are the same tokens; the decoder's hits keep fewer bytes crossing than without it."""
    _, report, folder = tiny_run
    off, on = (next(r for r in report["runs"] if r["setting"] == s) for s in ("off", "on"))
    assert report["same_answers"]
    assert on["prefix_cache_queries"] == sum(t["prompt"] for t in on["turns"])
    assert 0 < on["prefix_cache_hits"] == on["cached_tokens"] < on["prefix_cache_queries"]
    assert on["prefix_cache_hit_rate"] == on["prefix_cache_hits"] / on["prefix_cache_queries"]
    hits = multiturn.trace_figures(folder / "on.jsonl")["producer_prefix_cache_hits"]
    assert hits == on["cached_tokens"]
    assert off["cached_tokens"] == off["prefix_cache_hits"] == 0
    assert off["decoder_hit_rate"] == 0 < on["decoder_hit_rate"]
    assert on["bytes_handed_off"] < off["bytes_handed_off"]


@TWO_SERVERS
def test_pdsim_plays_the_same_workload_as_the_bench(tiny_run):
    """Calibrated on the tiny run's own traces, pdsim's uncached run of the same options
    hands off exactly the bytes the server did and computes every prompt token (the same
    prompts), with and without the host load the bench measured as an input; every figure
    is predicted. (With the cache, which turns hit depends on timing: sessions' first turns
    race for the system prompt's pages.)"""
    _, report, folder = tiny_run
    (folder / "report.json").write_text(json.dumps(report))
    for run in report["runs"]:
        assert run["host_load"]["taken_cores"] >= 0
    rows = multiturn_sim.compare(multiturn_sim._parse(["--train", str(folder)]))
    settings = [r["setting"] for r in report["runs"]]
    assert [(r["host_load"], r["setting"]) for r in rows] == \
        [(True, s) for s in settings] + [(False, s) for s in settings]
    for row in rows:
        assert row["role"] == "calibration"
        if row["setting"] == "off":
            prompts = sum(t["prompt"] for t in report["runs"][0]["turns"])
            assert row["predicted"]["bytes"] == row["measured"]["bytes"] > 0
            assert row["predicted"]["computed_tokens"] == row["measured"]["computed_tokens"] \
                == prompts
        assert all(row["predicted"][k] is not None for k in multiturn_sim.FIGURES)


def test_the_trace_figures_count_reserves_hits_and_spans(tmp_path):
    """Hit rate from reserve prefixes over prompts, producer hit tokens from computed hits,
    tokens computed from the other computed events (layer by layer too), bytes from issues,
    the pool and the producer's cache budget from the header."""
    rows = [{"kind": "header", "version": 4, "pool_pages": 9, "prefix_cache_pages": 5,
             "geometry": {"page_tokens": 4, "layers": 2}},
            {"kind": "reserve", "req": "a", "prompt": 10, "prefix": 0},
            {"kind": "computed", "req": "a", "layers": [0, 2], "tokens": [0, 10]},
            {"kind": "issue", "req": "a", "bytes": 100},
            {"kind": "reserve", "req": "b", "prompt": 30, "prefix": 8},
            {"kind": "computed", "req": "b", "layers": [0, 2], "tokens": [8, 16],
             "hit": [3, 4]},
            {"kind": "computed", "req": "b", "layers": [0, 1], "tokens": [16, 30]},
            {"kind": "computed", "req": "b", "layers": [1, 2], "tokens": [16, 30]},
            {"kind": "issue", "req": "b", "bytes": 220}]
    trace = tmp_path / "on.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert multiturn.trace_figures(trace) == {
        "prefix_cache_hit_rate": 8 / 40, "producer_prefix_cache_hits": 8, "bytes": 320,
        "computed_tokens": 10 + 14,
        "pool_pages": 9, "producer_cache_pages": 5, "decoder_cache_pages": 0}


@pytest.mark.parametrize("report, says", [
    (None, "holds no report.json"), ("", "report.json is not JSON"),
    ("[1]", "is not bench/multiturn.py's report"),
    ('{"options": {}, "runs": [{"setting": "on"}]}', "no trace of setting 'on'")])
def test_a_folder_that_is_not_a_bench_run_is_refused(tmp_path, capsys, report, says):
    """--train naming a folder without a whole bench run: one line naming why, exit 2."""
    if report is not None:
        (tmp_path / "report.json").write_text(report)
    with pytest.raises(SystemExit) as stop:
        multiturn_sim.main(["--train", str(tmp_path)])
    assert stop.value.code == 2
    assert says in capsys.readouterr().err
