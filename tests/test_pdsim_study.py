"""`pdsim study`: overlap's serving gain over whole copy, where the model says it pays."""

import csv

from pdsim.cli import main
from pdsim.study import AXES, MODES, Point, run_point, with_gains


def gains(**changes) -> dict[str, float]:
    """chunk's and layer's tokens/s gain over whole (percent) at one study point, under the
    seed-eager engine (the source design's answers)."""
    base = dict(hw="a100-pcie", engine="seed-eager", model="qwen3-0.6b", axis="x",
                prompt=4096, concurrency=8, bandwidth=1.0, contention=None, source=2)
    base.update(changes)
    rows = with_gains([run_point(Point(mode=m, **base), 12, 16, 256)
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
    """`pdsim study` writes report.md (the answer under each engine, findings, the brief's
    spread), a PNG per device and engine and the CSV with one row per device, engine,
    model, axis value, series and mode (the base point at both concurrencies too)."""
    out = tmp_path / "s"
    argv = ["study", "--models", "qwen3-0.6b", "--requests", "3", "--output-tokens", "2",
            "--prompt", "1024", "--jobs", "1", "--hw", "h200",
            "--engine", "production,seed-eager", "--out", str(out)]
    assert main(argv) == 0
    rows = list(csv.DictReader((out / "study.csv").open()))
    per_series = sum(len(v) for a, v in AXES.items() if a != "concurrency")
    assert len(rows) == 2 * len(MODES) * (2 * (per_series + 1) + len(AXES["concurrency"]))
    text = (out / "report.md").read_text()
    assert "## The answer under each engine" in text and "-3% .. +17%" in text
    for engine in ("production", "seed-eager"):
        assert f"## h200 under {engine}" in text and f"| qwen3-0.6b | h200 | {engine} | 1 |" \
            in text
        png = out / f"study-qwen3-0.6b-h200-{engine}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and png.name in text


def test_overlap_pays_more_when_compute_runs_at_the_chips_speed():
    """One request at a time on h200: whole copy's tail is a larger share of the prefill
    under the production engine than under seed-eager, and chunk overlap gains more."""
    rows = {}
    for engine in ("production", "seed-eager"):
        base = dict(hw="h200", engine=engine, model="qwen3-0.6b", axis="base", prompt=4096,
                    concurrency=1, bandwidth=1.0, contention=None, source=2)
        rows[engine] = {r["mode"]: r for r in with_gains(
            [run_point(Point(mode=m, **base), 6, 16, 256) for m in MODES])}
    share = {e: r["whole"]["tail_mean_s"] / r["whole"]["prefill_s"] for e, r in rows.items()}
    assert share["production"] > 3 * share["seed-eager"]
    assert rows["production"]["chunk"]["gain_pct"] > rows["seed-eager"]["chunk"]["gain_pct"]


def test_bad_study_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys):
    """An unknown model or a request count below 1: one line, exit 2, no folder made."""
    for extra in (["--models", "nope"], ["--requests", "0"], ["--engine", "nope"],
                  ["--hw", "a100-pcie,nope"]):
        assert main(["study", "--out", str(tmp_path / "s")] + extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert not (tmp_path / "s").exists()
