"""`pdsim study`: overlap's serving gain over whole copy, where the model says it pays."""

import csv

from pdsim.cli import main
from pdsim.study import AXES, MODES, Point, run_point, with_gains


def gains(**changes) -> dict[str, float]:
    """chunk's and layer's tokens/s gain over whole (percent) at one study point, under the
    seed-eager engine (the source design's answers)."""
    base = dict(model="qwen3-0.6b", axis="x", prompt=4096, concurrency=8, bandwidth=1.0,
                contention=None, source=2)
    base.update(changes)
    rows = with_gains([run_point(Point(mode=m, **base), "a100-pcie", 12, 16, 256, "seed-eager")
                       for m in MODES])
    return {r["mode"]: r["gain_pct"] for r in rows}


def test_overlap_pays_when_the_loop_waits_for_the_copy():
    """One request at a time on a slow link: chunk and layer beat whole by more than 10%."""
    g = gains(concurrency=1, bandwidth=0.125)
    assert g["whole"] == 0.0 and g["chunk"] > 10 and g["layer"] > 10


def test_overlap_gains_nothing_when_the_next_prefill_hides_the_copy():
    """Several requests and a two-prompt source cache: whole copy hides its tail behind the
    next prefill; with a one-prompt cache it cannot, and overlap pays again."""
    hidden, serial = gains(source=2), gains(source=1)
    assert abs(hidden["chunk"]) < 1.0
    assert serial["chunk"] > 2.0


def test_study_command_writes_report_plots_and_every_row(tmp_path, capsys):
    """`pdsim study` writes report.md (findings, the brief's spread), a PNG and the CSV with
    one row per model, axis value, series and mode."""
    out = tmp_path / "s"
    argv = ["study", "--models", "qwen3-0.6b", "--requests", "3", "--output-tokens", "2",
            "--prompt", "1024", "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    rows = list(csv.DictReader((out / "study.csv").open()))
    per_series = sum(len(v) for a, v in AXES.items() if a != "concurrency")
    assert len(rows) == len(MODES) * (2 * per_series + len(AXES["concurrency"]))
    text = (out / "report.md").read_text()
    assert "## Findings" in text and "-3% .. +17%" in text and "study-qwen3-0.6b.png" in text
    assert (out / "study-qwen3-0.6b.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_study_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    """An unknown model or a request count below 1: one line, exit 2, no folder made."""
    for extra in (["--models", "nope"], ["--requests", "0"]):
        assert main(["study", "--out", str(tmp_path / "s")] + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert not (tmp_path / "s").exists()
