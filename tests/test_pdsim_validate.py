"""pdsim validate: engine grid -> calibrate -> predict held-out; errors, table, PNG, JSON."""

import json

import attrs
import pytest

from pdref.models import load_model
from pdsim.cli import main
from pdsim.core.config import RequestSpec
from pdsim.core.costs import Costs
from pdsim.fit.engine_runs import EnginePoint, ExportPoint, export_argv, measure
from pdsim.fit.predict import paced, predict, simulate_point
from pdsim.fit.validate import EXPORT_GRIDS, GRIDS, Row, summary
from pdsim.views.report import write_trace


def _costs(h2d_byte_s: float) -> Costs:
    return Costs(token_s=1e-4, pair_s=0.0, chunk_s=1e-3, span_s=1e-4, gather_byte_s=1e-10,
                 link_stages=(("d2h", 1e-10), ("h2d", h2d_byte_s)), link_latency_s=0.0)


def test_paced_slows_each_link_direction_to_the_link_rate():
    """A paced run's d2h and h2d stages each run at link_gbps; a slower fitted rate is kept."""
    fast, slow = paced(_costs(1e-10), 0.5), paced(_costs(1e-8), 0.5)
    assert dict(fast.link_stages) == pytest.approx({"d2h": 2e-9, "h2d": 2e-9})
    assert dict(slow.link_stages) == pytest.approx({"d2h": 2e-9, "h2d": 1e-8})
    assert paced(_costs(1e-10), None) == _costs(1e-10)


def test_measure_matches_pdref_metrics_on_a_simulated_trace(tmp_path):
    """measure() of a one-request trace gives pdref's handoff, tail and staging."""
    spec, point = load_model("tiny"), EnginePoint(256, 64, prefix=32)
    result = simulate_point(spec, "a100-pcie", point, "chunk")
    write_trace(str(tmp_path / "t.jsonl"), result)
    m = measure(tmp_path / "t.jsonl", "chunk", {"metrics": {}, "parity": {
        "kv_equal": True, "token_equal": True}})
    expected = predict(spec, "a100-pcie", point, "chunk")
    assert m.handoff_s == pytest.approx(expected["handoff_s"])
    assert m.tail_s == pytest.approx(expected["tail_s"])
    assert m.peak_staging_bytes == expected["peak_staging_bytes"] and m.parity


def test_summary_is_over_held_out_rows_only():
    """Median and worst errors count the held-out rows, not the training rows."""
    from pdsim.fit.engine_runs import Measured

    def row(role, meas, pred):
        m = Measured("whole", "t", meas, 0.01, meas - 0.01, 0, None, True)
        return Row(EnginePoint(64, 32), role, m, {"handoff_s": pred, "tail_s": 0.01,
                                                  "peak_staging_bytes": 0})

    rows = [row("test", 1.0, 1.1), row("test", 1.0, 0.98), row("train", 1.0, 3.0)]
    s = summary(rows)
    assert s["n"] == 2 and s["worst_handoff_err_pct"] == pytest.approx(10.0)
    assert s["median_handoff_err_pct"] == pytest.approx(6.0)
    assert s["median_tail_err_pct"] == 0.0


def test_grids_hold_out_points_and_cover_every_role():
    """Every grid has training and held-out points, none in both."""
    for grid in GRIDS.values():
        train = {p for p, r in grid if r == "train"}
        test = {p for p, r in grid if r == "test"}
        assert train and test and not train & test


def test_export_grids_calibrate_on_whole_copies_and_hold_out_chunked_ones():
    """Export profiles come from whole copies only (two payloads in the default grid, so
    per-byte and fixed costs separate); chunked exports are held out."""
    for grid in EXPORT_GRIDS.values():
        assert {p.mode for p, r in grid if r == "train"} == {"whole"}
        assert "chunk" in {p.mode for p, r in grid if r == "test"}
    assert len({p.payload for p, r in EXPORT_GRIDS["default"] if r == "train"}) >= 2


def test_export_point_runs_pdgpu_export_and_predicts_its_payload(tmp_path):
    """An export point is `pdgpu run --no-compute --payload` in its mode; the simulator moves
    the same payload (rounded up to whole tokens), and measure() reads what predict() says."""
    point = ExportPoint(1_000_000, "chunk", 64, max_pending=1, link_gbps=0.5)
    argv = export_argv(point, "tiny", tmp_path / "t.jsonl", 3)
    assert argv[argv.index("--payload") + 1] == "1000000" and "--no-compute" in argv
    assert argv[argv.index("--link-gbps") + 1] == "0.5"
    spec = load_model("tiny")
    result = simulate_point(spec, "a100-pcie", point, "chunk")
    write_trace(str(tmp_path / "t.jsonl"), result)
    m = measure(tmp_path / "t.jsonl", "chunk", {"metrics": {}, "parity": {
        "kv_equal": True, "token_equal": True}})
    expected = predict(spec, "a100-pcie", point, "chunk")
    assert expected["bytes"] == -(-1_000_000 // 512) * 512
    assert m.handoff_s == pytest.approx(expected["handoff_s"])


def test_quick_grid_end_to_end(tmp_path, capsys):
    """The quick grid on the tiny engine: one JSON object, every config, a PNG and a profile."""
    code = main(["validate", "--model", "tiny", "--grid", "quick", "--requests", "1",
                 "--out", str(tmp_path), "--json", "--quiet"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["configs"]) == 3 * len(GRIDS["quick"])
    assert len(out["export_configs"]) == len(EXPORT_GRIDS["quick"])
    assert out["export"]["n"] == 1 and "median_handoff_err_pct" in out["export"]
    for key in ("median_handoff_err_pct", "worst_handoff_err_pct", "median_tail_err_pct"):
        assert 0 <= out[key] < float("inf")
    assert all(c["parity"] for c in out["configs"])
    assert (tmp_path / "validation.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["run", "--hw", str(tmp_path / "profile.toml"), "--model", "tiny",
                 "--prompt", "128", "--chunk", "32", "--json"]) == 0


def test_bad_requests_is_one_line_exit_2(tmp_path, capsys):
    """--requests 0 is refused with one line naming the flag, exit 2, nothing written."""
    assert main(["validate", "--requests", "0", "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert "--requests" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "v").exists()


def test_row_error_is_relative_to_measured():
    """handoff_err_pct is |predicted/measured - 1| in percent."""
    from pdsim.fit.engine_runs import Measured

    m = Measured("chunk", "t", 2.0, 0.002, 1.998, 0, None, True)
    r = Row(EnginePoint(64, 32), "test", m, {"handoff_s": 1.5, "tail_s": 0.003,
                                             "peak_staging_bytes": 0})
    assert r.handoff_err_pct == pytest.approx(25.0)
    assert r.tail_err_pct == pytest.approx(25.0)  # 1 ms of max(2 ms, 4 ms)
    assert attrs.asdict(r.point)["prompt"] == 64


@pytest.mark.parametrize("dense", [False, True])
def test_head_and_attention_shape_recovered_from_sim_traces(tmp_path, dense):
    """head_s, pair_s and the attention shape (causal or dense) are recovered from sim traces."""
    from pdsim.core.config import SimConfig
    from pdsim.core.costs import costs_for, sim_geometry
    from pdsim.core.engines import load_engine
    from pdsim.core.play import simulate
    from pdsim.core.profiles import link_of, load_hw
    from pdsim.fit.calibrate import calibrate

    spec, hw = load_model("qwen3-0.6b"), load_hw("a100-pcie")
    base = costs_for(spec, hw, link_of(hw), load_engine("seed-eager"))
    costs = attrs.evolve(base, head_s=0.004, dense_attention=dense)
    paths = []
    for mode, chunk, prompt in (("chunk", 256, 3000), ("whole", 512, 2000),
                                ("layer", 384, 1500), ("chunk", 128, 1000)):
        cfg = SimConfig(sim_geometry(spec), costs, mode, chunk, pool_pages=1024,
                        labels=(("model", spec.name),))
        result = simulate(cfg, [RequestSpec(f"r{i}", 0.0, prompt, 16) for i in range(2)])
        paths.append(str(tmp_path / f"{mode}{chunk}.jsonl"))
        write_trace(paths[-1], result)
    cal = calibrate(paths)
    assert cal.head_s == pytest.approx(0.004)
    assert cal.dense_attention is dense
    assert cal.compute.get("pair_s") == pytest.approx(costs.pair_s, rel=0.01)
    assert cal.span_s == pytest.approx(costs.span_s, rel=0.01)
