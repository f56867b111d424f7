"""pdsim demo: engine runs, calibration, predictions, sweeps, checks, report in one folder."""

import json
import re

import pytest

from pdsim.cli import main


@pytest.mark.timeout(360)  # ~50 s alone; a hang guard, not a clock: it ran near 120 s at load 10
def test_demo_tiny_end_to_end(tmp_path, capsys):
    """A tiny demo writes a report whose PNG links exist, every trace legal (the hybrid
    study's too), parity ok, and its served prompts streamed through `pdgpu serve --http`
    give the chunk run's tokens."""
    out = tmp_path / "demo"
    code = main(["demo", "--out", str(out), "--model", "tiny", "--prompt", "128",
                 "--chunks", "32,64", "--requests", "1", "--quiet"])
    assert code == 0
    report = (out / "report.md").read_text()
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", report)
    assert len(links) == 4 and all((out / p).read_bytes()[:4] == b"\x89PNG" for p in links)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 6 and all(r["parity"] for r in summary["runs"])
    assert len(summary["checks"]) == 21 and all(c["ok"] for c in summary["checks"])
    assert sum("/hybrid/traces/" in c["file"] for c in summary["checks"]) == 6
    assert summary["served"]["http"]["tokens_equal"] is True
    served = summary["served"]
    assert served["parity"]["ok"] and [r["mode"] for r in served["runs"]] == ["whole", "chunk"]
    assert all(r["ok"] == 6 and r["leaked_pages"] == 0 for r in served["runs"])
    assert "## Served run" in report
    assert "## Does overlap pay? Under each engine" in report
    answer = summary["answer"]
    assert {(r["hw"], r["engine"]) for r in answer} == {
        (hw, e) for hw in ("a100-pcie", "h200") for e in ("production", "seed-eager")}
    assert "## Hybrid models: how much smaller is the handoff" in report
    hybrid = summary["hybrid"]
    assert {r["model"] for r in hybrid} == {"qwen3-0.6b", "qwen3.5-27b", "qwen3.5-27b+full",
                                            "gemma-3-27b", "gemma-3-27b+full"}
    assert {r["prompt"] for r in hybrid} == {2048, 4096, 8192, 16384, 32768}
    assert (out / "profile.toml").exists()
    printed = capsys.readouterr().out
    assert "handoff ms" in printed and "predicted" in printed


@pytest.mark.parametrize("argv, flag", [(["--chunks", "0"], "--chunks"),
                                        (["--prompt", "0"], "--prompt"),
                                        (["--model", "no-such-model"], "no-such-model")])
def test_demo_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, flag):
    """Bad demo options are one line naming the field, exit 2, no output folder."""
    assert main(["demo", "--out", str(tmp_path / "d"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and len(err.splitlines()) == 1
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
def test_default_demo_exits_0(tmp_path):
    """The default demo (no options but --out) runs to the end with exit 0 (its time is the
    report's `wall_s`, not a clock assertion here; a hang fails by the test's timeout)."""
    assert main(["demo", "--out", str(tmp_path / "demo"), "--quiet"]) == 0


def test_engine_failure_is_one_line_exit_1(tmp_path, capsys):
    """An engine that refuses its device is reported in one line naming it, exit 1."""
    code = main(["demo", "--out", str(tmp_path / "d"), "--model", "tiny", "--prompt", "64",
                 "--chunks", "32", "--requests", "1", "--device", "no-such-device", "--quiet"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert "engine error" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "d" / "report.md").exists()


def test_a_served_run_that_fails_is_an_engine_error(tmp_path):
    """pdgpu serve refusing its device raises the demo's engine error (one line, exit 1 in
    the command), not an unhandled exception."""
    from pdsim.demo_serve import ServeDemo, run_served
    from pdsim.fit.engine_runs import EngineRunError

    with pytest.raises(EngineRunError, match="pdgpu serve --mode whole: exit 2: ") as caught:
        run_served(ServeDemo(model="tiny", device="no-such-device"), tmp_path / "serve")
    assert len(str(caught.value).splitlines()) == 1


@pytest.mark.slow
def test_demo_http_streams_the_served_prompts(tmp_path):
    """`pdsim demo --http`'s step: prompts streamed through `pdgpu serve --http` with the
    openai client give the tokens `pdgpu generate` gives; the server drains, nothing leaks."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from pdsim.demo_http import run_http
    from pdsim.demo_serve import ServeDemo, reference_output, write_prompts
    demo = ServeDemo(model="tiny", prompt_range=(32, 64), chunk=32)
    lines = write_prompts(demo, tmp_path / "prompts.jsonl")
    chunk_run = {"results": {x["req"]: {"output": reference_output(demo, x)}
                             for x in lines[:2]}}
    http = run_http(demo, tmp_path, lines, chunk_run, count=2)
    assert http["tokens_equal"] and http["ok"] and http["summary"]["ok"] == 2
    assert (tmp_path / "http.jsonl").exists()


@pytest.mark.timeout(360)  # a hang guard like the tiny demo's: 102 s at load 11 (2026-12-05)
def test_demo_without_http_starts_no_server(tmp_path):
    """--no-http: the demo's served part runs in batch mode only (no HTTP trace)."""
    out = tmp_path / "demo"
    code = main(["demo", "--out", str(out), "--model", "tiny", "--prompt", "64",
                 "--chunks", "32", "--requests", "1", "--quiet", "--no-http"])
    assert code == 0
    assert not (out / "serve" / "http.jsonl").exists()
    assert json.loads((out / "summary.json").read_text())["served"]["http"] == {}
