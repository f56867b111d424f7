"""The pdsim command line: run, sweep, explain, timeline, and bad input handling."""

import json

import pytest

from pdref.check import check_file
from pdref.cli import main as pdref_main
from pdsim.cli import main


def test_run_prints_design_metric_names(capsys):
    """`pdsim run --json` prints contract.md's metric names plus the lower bound and gap."""
    assert main(["run", "--json", "--mode", "chunk", "--prompt", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("mode", "prompt", "prefix", "chunk", "max_pending", "bytes", "spans",
                "prefill_s", "handoff_s", "tail_s", "peak_staging_bytes", "first_token",
                "lower_bound_s", "gap_s"):
        assert key in out
    assert out["first_token"] is None and out["spans"] == 4


def test_run_trace_passes_pdref_check_cli(tmp_path, capsys):
    """A trace written by `pdsim run --trace` passes `pdref check`."""
    trace = tmp_path / "run.jsonl"
    assert main(["run", "--mode", "layer", "--prompt", "300", "--trace", str(trace)]) == 0
    assert pdref_main(["check", str(trace)]) == 0
    assert "ok:" in capsys.readouterr().out


def test_workload_run_reports_ttft_percentiles(tmp_path, capsys):
    """A Poisson workload prints TTFT p50/p99, occupancy and throughput; its trace is legal."""
    trace = tmp_path / "w.jsonl"
    argv = ["run", "--json", "--requests", "30", "--rate", "5", "--prompt-range", "256:2048",
            "--mode", "chunk", "--output-tokens", "16", "--trace", str(trace)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 30 and out["ttft_p99_s"] >= out["ttft_p50_s"] > 0
    assert 0 < out["pool_occupancy_mean"] <= 1 and out["throughput_rps"] > 0
    assert check_file(trace).ok


def test_prompts_csv_workload(tmp_path, capsys):
    """Prompts and arrivals can come from a CSV file."""
    path = tmp_path / "w.csv"
    path.write_text("prompt,arrival\n100,0\n200,0.5\n300,0.25\n")
    assert main(["run", "--json", "--prompts-csv", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 3


@pytest.mark.parametrize("argv, field", [
    (["run", "--prompt", "0"], "prompt"),
    (["run", "--prefix", "5"], "prefix"),
    (["run", "--chunk", "0"], "--chunk"),
    (["run", "--max-pending", "0"], "--max-pending"),
    (["run", "--hw", "nope"], "hw"),
    (["run", "--model", "qwen3-next-80b-a3b", "--mode", "layer"], "CFG-1"),
    (["run", "--prompt", "abc"], "--prompt"),
    (["sweep", "--chunks", "0,64"], "--chunks"),
    (["sweep", "--prefix", "-16"], "--prefix"),
    (["sweep", "--modes", "whole,bogus"], "--modes"),
    (["run", "--pool-pages", "2", "--prompt", "4096"], "pool_pages"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, field):
    """Bad input: exit 2, one stderr line naming the field, and no trace written."""
    trace = tmp_path / "t.jsonl"
    assert main([*argv, *(["--trace", str(trace)] if argv[0] == "run" else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "Traceback" not in err
    assert not trace.exists()


def test_sweep_writes_csv_json_png(tmp_path, capsys):
    """`pdsim sweep` writes CSV, JSON and a PNG and names the best chunk per prompt."""
    argv = ["sweep", "--chunks", "128,512", "--prompts", "1024,2048", "--jobs", "2",
            "--csv", str(tmp_path / "s.csv"), "--json", str(tmp_path / "s.json"),
            "--png", str(tmp_path / "s.png")]
    assert main(argv) == 0
    assert "best for prompt 2048" in capsys.readouterr().out
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert len(rows) == 3 * 2 * 2
    assert (tmp_path / "s.csv").read_text().count("\n") == 13
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_parallel_equals_serial():
    """The process pool gives the same rows as a serial sweep."""
    from pdsim.options import Parser, base_config
    from pdsim.sweep import add_args, grid, run_sweep

    p = Parser()
    add_args(p)
    args = p.parse_args(["--chunks", "64,256,1024", "--prompts", "512,4096"])
    base = base_config(args)
    points = grid(args)
    assert run_sweep(base, points, jobs=2, progress=False) == run_sweep(
        base, points, jobs=1, progress=False)


def test_explain_names_the_binding_resource(capsys):
    """explain says compute bounds a compute-heavy run and the copy path a slow-link one,
    and names what it simulated (the engine too)."""
    assert main(["explain", "--mode", "chunk", "--prompt", "2048"]) == 0
    out = capsys.readouterr().out
    assert "bound by compute" in out and "on a100-pcie under the production engine" in out
    assert main(["explain", "--mode", "chunk", "--prompt", "2048", "--bandwidth-scale",
                 "0.02"]) == 0
    assert "bound by the copy path" in capsys.readouterr().out


def test_timeline_writes_png_and_perfetto(tmp_path, capsys):
    """timeline writes a Gantt PNG and Chrome trace JSON with one track per resource."""
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["timeline", "--mode", "chunk", "--prompt", "1024", "--png", str(png),
                 "--perfetto", str(trace)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    names = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("name") == "thread_name"}
    assert {"p0.compute", "p0.gather", "p0.d2h", "p0.h2d"} <= names


def test_copier_option_overrides_the_profile_and_labels_the_trace(tmp_path, capsys):
    """`--copier pipelined` under the serial seed-eager engine: a faster chunked export, and the
    trace header says which copier ran; an unknown copier is one line, exit 2."""
    argv = ["run", "--json", "--no-compute", "--payload", str(2**30), "--mode", "chunk",
            "--engine", "seed-eager"]
    assert main(argv) == 0
    serial = json.loads(capsys.readouterr().out)["handoff_s"]
    trace = tmp_path / "p.jsonl"
    assert main([*argv, "--copier", "pipelined", "--trace", str(trace)]) == 0
    assert json.loads(capsys.readouterr().out)["handoff_s"] < 0.95 * serial
    assert json.loads(trace.read_text().splitlines()[0])["copier"] == "pipelined"
    assert main([*argv, "--copier", "parallel"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--copier" in err
