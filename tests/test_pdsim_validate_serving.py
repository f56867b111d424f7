"""`pdsim validate --serving`: serve runs' prompts and command lines, errors and summaries,
and the whole calibrate-then-predict pipeline against a simulated engine."""

import json
import statistics

import attrs
import pytest

from pdref.models import SPECS_DIR, load_model
from pdsim.cli import main
from pdsim.core.costs import Costs
from pdsim.core.metrics import workload_metrics
from pdsim.core.play import simulate
from pdsim.core.profiles import load_hw
from pdsim.fit import validate_serving as vs
from pdsim.fit.host_load import HostLoad
from pdsim.fit.serve_runs import ServePoint, ServeRun, draw_prompts, serve_argv
from pdsim.views.report import write_trace

SMALL = load_model("small")
def seed_a100_text() -> str:
    """a100-pcie's datasheet plus seed-eager's software figures, as one calibrated-style hw
    profile (the form `pdsim calibrate` writes): the base a truth profile adds terms to."""
    seed = (SPECS_DIR / "engines" / "seed-eager.toml").read_text().splitlines()
    software = [line for line in seed if line.split(" = ")[0] in SOFTWARE_KEYS]
    return (SPECS_DIR / "hw" / "a100-pcie.toml").read_text() + "\n".join(software) + \
        "\ngather_bandwidth = 800e9\n"


SOFTWARE_KEYS = ("efficiency", "chunk_s", "span_s", "copier", "contention")
TRUTH_COMPUTE = """
[compute]
token_s = 2e-4
chunk_s = 5e-3
head_s = 2e-3
decode_s = 4e-3
decode_row_s = 5e-4
decode_kv_token_s = 2e-6
decode_gap_s = 1e-3
land_byte_s = 2e-9
admit_byte_s = 1e-9
"""


def test_drawn_prompts_are_seeded_and_in_range():
    """Prompts: `requests` lines, lengths inside the range (both ends), ids inside the
    vocabulary, the same for the same seed and different for another."""
    point = ServePoint(2, (10, 20), 5, requests=40, seed=3)
    rows = draw_prompts(point, 50)
    assert [r["req"] for r in rows] == [f"r{i}" for i in range(40)]
    lengths = {len(r["tokens"]) for r in rows}
    assert min(lengths) >= 10 and max(lengths) <= 20 and len(lengths) > 5
    assert all(0 <= t < 50 for r in rows for t in r["tokens"])
    assert all(r["output_tokens"] == 5 for r in rows)
    assert draw_prompts(point, 50) == rows
    assert draw_prompts(ServePoint(2, (10, 20), 5, requests=40, seed=4), 50) != rows


def test_serve_argv_carries_every_setting(tmp_path):
    """The engine command names the point's prompts, loop, producers, mode, chunk and pacing
    (pacing only when the point is paced), and no prefix cache (the simulator plays none)."""
    point = ServePoint(3, (8, 16), 4, producers=2, mode="layer", link_gbps=0.05, chunk=32)
    argv = serve_argv(point, "tiny", tmp_path / "p.jsonl", tmp_path / "t.jsonl")
    pairs = dict(zip(argv, argv[1:], strict=False))
    assert pairs["--prompts"] == str(tmp_path / "p.jsonl")
    assert (pairs["--concurrency"], pairs["--producers"], pairs["--mode"],
            pairs["--chunk"], pairs["--link-gbps"]) == ("3", "2", "layer", "32", "0.05")
    assert "--no-prefix-cache" in argv
    assert "--link-gbps" not in serve_argv(ServePoint(1, (8, 16), 4), "tiny",
                                           tmp_path / "p", tmp_path / "t")


def _row(role, measured_tps, predicted_tps, measured_ttft, predicted_ttft):
    run = ServeRun(ServePoint(1, (8, 8), 1), [], "t.jsonl",
                   {"tokens_per_s": measured_tps, "ttft_p50_s": measured_ttft})
    return vs.ServeRow(run, role, {"tokens_per_s": predicted_tps,
                                   "ttft_p50_s": predicted_ttft})


def test_summary_is_median_and_worst_of_held_out_rows_only():
    """Errors are |predicted/measured - 1|; the summary takes the test rows' median and max
    and leaves the training rows out."""
    rows = [_row("test", 100, 110, 1.0, 0.9), _row("test", 50, 49, 2.0, 2.5),
            _row("test", 10, 10, 1.0, 1.0), _row("train", 10, 100, 1.0, 9.0)]
    assert rows[0].err_pct("tokens_per_s") == pytest.approx(10.0)
    got = vs.serving_summary(rows)
    assert got["n"] == 3
    assert got["median_tps_err_pct"] == pytest.approx(2.0)
    assert got["worst_tps_err_pct"] == pytest.approx(10.0)
    assert got["median_ttft_p50_err_pct"] == pytest.approx(10.0)
    assert got["worst_ttft_p50_err_pct"] == pytest.approx(25.0)
    assert vs.serving_summary(rows, "train")["worst_tps_err_pct"] == pytest.approx(900.0)


def test_default_grid_spans_the_serving_axes():
    """The default grid varies concurrency, prompt range, output tokens, producers, mode and
    link pacing, and both halves (train, test) hold paced, multi-producer and every mode."""
    grid = vs.SERVE_GRIDS["default"]
    for half in ("train", "test"):
        points = [p for p, role in grid if role == half]
        assert {p.mode for p in points} == {"whole", "chunk", "layer"} or half == "train"
        assert any(p.link_gbps for p in points) and any(p.producers > 1 for p in points)
    points = [p for p, _ in grid]
    for axis in ("concurrency", "prompt_range", "output_tokens", "producers", "mode",
                 "link_gbps"):
        assert len({getattr(p, axis) for p in points}) > 1, axis
    repeats = [i for i, (_, role) in enumerate(grid) if role == "repeat"]
    assert repeats and repeats == list(range(len(grid) - len(repeats), len(grid)))
    for i in repeats:  # a held-out point served again at the grid's end
        assert (grid[i][0], "test") in grid[:repeats[0]]


def _served(point: ServePoint, tps: float, ttft: float) -> ServeRun:
    return ServeRun(point, [], "", {"tokens_per_s": tps, "ttft_p50_s": ttft})


def test_repeat_summary_pairs_each_repeat_with_its_points_first_run():
    """Each repeat against the first run of its point (not another repeat, not another
    point): |repeat / first - 1| of tokens/s and TTFT p50, worst over the pairs."""
    a, b = ServePoint(2, (64, 256), 16), ServePoint(4, (64, 256), 32, mode="whole")
    runs = [(_served(a, 40.0, 0.20), "test"), (_served(b, 100.0, 0.50), "train"),
            (_served(a, 44.0, 0.19), "repeat"), (_served(b, 90.0, 0.60), "repeat"),
            (_served(a, 30.0, 0.25), "repeat")]
    got = vs.repeat_summary(runs)
    assert got["n"] == 3 and [p["name"] for p in got["pairs"]] == [a.name, b.name, a.name]
    assert [p["tps_diff_pct"] for p in got["pairs"]] == pytest.approx([10.0, 10.0, 25.0])
    assert [p["ttft_p50_diff_pct"] for p in got["pairs"]] == pytest.approx([5.0, 20.0, 25.0])
    assert got["pairs"][1]["tokens_per_s"] == [100.0, 90.0]
    assert got["worst_tps_diff_pct"] == pytest.approx(25.0)
    assert got["worst_ttft_p50_diff_pct"] == pytest.approx(25.0)
    assert vs.repeat_summary(runs[:2]) == {"n": 0}


def test_prediction_plays_the_runs_prompts_and_pacing():
    """The simulator serves exactly the run's requests and outputs; pacing the link to a
    crawl lowers tokens/s."""
    point = ServePoint(2, (64, 256), 8, requests=6)
    prompts = draw_prompts(point, SMALL.vocab)
    fast = vs.predict_serving(SMALL, "a100-pcie", ServeRun(point, prompts, "", {}))
    assert fast["requests"] == fast["ok"] == 6
    assert fast["generated_tokens"] == 6 * 8
    slow_point = ServePoint(2, (64, 256), 8, requests=6, link_gbps=0.001)
    slow = vs.predict_serving(SMALL, "a100-pcie", ServeRun(slow_point, prompts, "", {}))
    assert slow["tokens_per_s"] < 0.5 * fast["tokens_per_s"]


def _simulated_engine(truth: str):
    """A stand-in for `pdgpu serve`: the simulator on the truth profile, its trace and
    summary, for the same prompts the real run would get."""
    def run(point, model, vocab, folder, device=None):
        folder.mkdir(parents=True, exist_ok=True)
        prompts = draw_prompts(point, vocab)
        cfg, requests = vs.serving_setup(load_model(model), truth, point, prompts,
                                         stages=True)
        result = simulate(cfg, requests)
        write_trace(str(folder / "trace.jsonl"), result)
        return ServeRun(point, prompts, str(folder / "trace.jsonl"), workload_metrics(result))
    return run


@pytest.mark.parametrize("host_cores", [None, 1.0])
def test_validation_against_a_simulated_engine_is_exact(tmp_path, monkeypatch, capsys,
                                                        host_cores):
    """With the simulator itself as the engine, calibrating on the training runs' serving
    traces and predicting the held-out runs gives tokens/s and TTFT within 2%: the fit reads
    every term serving needs from serve-shaped traces, the shared host cores too (found, and
    none when the engine had dedicated devices). The command prints one JSON object with the
    issue's keys and writes the profile and the PNG."""
    truth = tmp_path / "truth.toml"  # a device unlike the base profile calibrate starts from
    shared = f"host_cores = {host_cores}\n" if host_cores else ""
    truth.write_text(seed_a100_text() + TRUTH_COMPUTE + shared)
    monkeypatch.setattr(vs, "run_serve", _simulated_engine(str(truth)))
    monkeypatch.setattr(vs, "engine_host_cores", lambda device: None)  # not this host's
    assert main(["validate", "--serving", "--model", "small", "--out", str(tmp_path / "v"),
                 "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["configs"]) == sum(r == "test" for _, r in vs.SERVE_GRIDS["default"])
    for key in ("median_tps_err_pct", "worst_tps_err_pct", "median_ttft_p50_err_pct",
                "worst_ttft_p50_err_pct"):
        assert 0 <= out[key] < 2.0, (key, out[key])
        # one run's trace alone need not separate every term (one prompt range, one mode;
        # sharing cores, one run's spans may never queue, so its copier is only assumed)
        if host_cores is None or "tps" in key:
            assert 0 <= out["in_sample"][key] < 10.0, (key, out["in_sample"][key])
    assert out["in_sample"]["n"] == len(out["configs"])
    # the repeats were served (into folders of their own) and paired: a simulated engine
    # serves identical work identically
    repeats = out["repeats"]
    assert repeats["n"] == sum(r == "repeat" for _, r in vs.SERVE_GRIDS["default"]) > 0
    assert repeats["worst_tps_diff_pct"] == repeats["worst_ttft_p50_diff_pct"] == 0.0
    assert all((tmp_path / "v" / "serve" / f"{p['name']}-repeat" / "trace.jsonl").exists()
               for p in repeats["pairs"])
    assert statistics.median(c["tps_err_pct"] for c in out["configs"]) == pytest.approx(
        out["median_tps_err_pct"])
    assert (tmp_path / "v" / "serving-validation.png").read_bytes()[:4] == b"\x89PNG"
    assert load_hw(str(tmp_path / "v" / "serving-profile.toml")).engine.compute.host_cores \
        == host_cores
    assert len(out["load_average"]) == 2
    assert main(["run", "--hw", str(tmp_path / "v" / "serving-profile.toml"), "--model", "small",
                 "--requests", "4", "--concurrency", "2", "--output-tokens", "4",
                 "--json"]) == 0


def _loaded_engine(truth: str, slowdown: float):
    """The simulated engine on a host where other work took a share of the 2 cores, a
    different share for each point (0..40%), slowing what ran by `slowdown` per share; each
    run carries the load as the monitor would have measured it."""
    grid = [p for p, _ in vs.SERVE_GRIDS["default"]]  # the share: by the point's place

    def run(point, model, vocab, folder, device=None):
        folder.mkdir(parents=True, exist_ok=True)
        prompts = draw_prompts(point, vocab)
        free = 1.0 - 0.1 * (grid.index(point) % 5)
        cfg, requests = vs.serving_setup(load_model(model), truth, point, prompts,
                                         stages=True)
        result = simulate(attrs.evolve(cfg, costs=vs.under_load(cfg.costs, free, slowdown)),
                          requests)
        write_trace(str(folder / "trace.jsonl"), result)
        summary = workload_metrics(result)
        load = HostLoad(summary["wall_s"], 2 * (1 - free) * summary["wall_s"], 0.0, 2)
        return ServeRun(point, prompts, str(folder / "trace.jsonl"), summary, load)
    return run


def test_measured_host_load_is_an_input_of_the_fit_and_the_predictions(tmp_path,
                                                                      monkeypatch):
    """An engine slowed by other work, each run by a different measured share: with the
    host load as an input the held-out runs are predicted within 2.5% (the slowdown found
    from the training traces alone); without it, not. (What is left is the layer-mode
    point's: from chunk-mode training runs the gather contention comes out 0.135 against
    the truth's 0.15, and its TTFT p50 2.1% long.)"""
    truth = tmp_path / "truth.toml"
    truth.write_text(seed_a100_text() + TRUTH_COMPUTE
                     + "host_cores = 2.0\n")
    monkeypatch.setattr(vs, "run_serve", _loaded_engine(str(truth), 0.8))
    monkeypatch.setattr(vs, "engine_host_cores", lambda device: 2)
    monkeypatch.setitem(vs.SERVE_GRIDS, "six", vs.SERVE_GRIDS["default"][:6])  # 2 and 4
    _, out = vs.validate_serving("small", "six", tmp_path / "v", progress=False)
    assert out["load_slowdown"] == pytest.approx(0.8)
    assert out["host_load_input"] is True
    for key in ("median_tps_err_pct", "worst_tps_err_pct", "median_ttft_p50_err_pct",
                "worst_ttft_p50_err_pct"):
        assert out[key] < 2.5, (key, out[key])
    assert out["without_host_load"]["worst_tps_err_pct"] > 10.0
    assert all(c["host_load"]["taken_cores"] >= 0 for c in out["configs"])


@pytest.mark.slow
def test_quick_serving_grid_on_the_engine(tmp_path, capsys):
    """The quick grid on the real engine (tiny model): every config measured and predicted."""
    assert main(["validate", "--serving", "--grid", "quick", "--model", "tiny", "--out",
                 str(tmp_path), "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["configs"]) == 1 and out["train"]["n"] == 1
    assert all(c["measured_tokens_per_s"] > 0 and c["predicted_tokens_per_s"] > 0
               for c in out["configs"] + out["train_configs"])


def test_unknown_model_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    """--serving with a model no shell knows: exit 2, one line naming it, no folder made."""
    assert main(["validate", "--serving", "--model", "no-such-model", "--out",
                 str(tmp_path / "v"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-model" in err
    assert not (tmp_path / "v").exists()


def test_under_load_slows_dedicated_devices_too():
    """Without shared host cores (dedicated devices) other work's measured share still
    slows each loaded term as calibrate took it out (fitting.alone divides by it there too);
    no core count appears."""
    costs = Costs(token_s=2e-5, pair_s=1e-8, chunk_s=2e-3, span_s=1e-5, gather_byte_s=1e-12,
                  link_stages=(("h2d", 1e-12),), link_latency_s=0.0, decode_s=0.01)
    loaded = vs.under_load(costs, 0.5, 1.0)
    assert loaded.host_cores is None
    assert loaded.chunk_s == pytest.approx(1.5 * costs.chunk_s)
    assert loaded.decode_s == pytest.approx(1.5 * costs.decode_s)
    assert loaded.span_s == costs.span_s  # copy terms: not a compute activity
