"""pdsim options: every input that one option would silently clamp or override is refused."""

from __future__ import annotations

import pytest

from pdsim.cli import main

RUN = ["run", "--model", "qwen3-0.6b", "--hw", "a100-pcie"]


def _refused(argv, capsys) -> str:
    """Run pdsim; assert exit 2 with one line on stderr and nothing on stdout; the line."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("argv,words", [
    (["--prompt", "100", "--prefix", "112"], "prefix"),
    (["--prompt", "100", "--prefix", "100"], "multiple of page_tokens"),
    (["--prompt-range", "64:128", "--prefix", "96", "--requests", "3"], "shortest prompt"),
    (["--prompt", "100", "--prompt-range", "1:5"], "--prompt and --prompt-range"),
    (["--no-compute", "--payload", "4096", "--prompt", "64"], "--prompt and --payload"),
    (["--payload", "4096"], "--payload needs --no-compute"),
    (["--rate", "1", "--interval", "0.5", "--requests", "2"], "--rate and --interval"),
    (["--arrivals", "0,1", "--interval", "0"], "--arrivals and --interval"),
    (["--arrivals", "0,1", "--requests", "3"], "--requests is 3"),
], ids=["prefix>prompt", "prefix=unaligned-prompt", "prefix>range", "prompt+range",
        "prompt+payload", "payload-needs-no-compute", "rate+interval", "arrivals+interval",
        "requests-vs-arrivals"])
def test_silent_repairs_are_refused(capsys, argv, words):
    """Each combination that used to be clamped or overridden is one line, exit 2."""
    assert words in _refused([*RUN, *argv], capsys)


def test_prefix_above_prompt_was_clamped_before(capsys):
    """--prefix above the prompt is refused rather than run as prefix = prompt."""
    err = _refused([*RUN, "--prompt", "8192", "--prefix", "9000"], capsys)
    assert "9000" in err and "prompt=8192" in err


@pytest.mark.parametrize("rows,extra,words", [
    ("prompt,arrival\n64,0\n64,\n", [], ":3: arrival is missing"),
    ("prompt,arrival\n64,0\n64,1\n", ["--rate", "2"], "--rate and --prompts-csv arrival"),
    ("prompt\n64\n64\n", ["--requests", "5"], "--requests is 5 but there are 2"),
    ("prompt,prefix\n64,16\n64,32\n", ["--prefix", "16"], "--prefix 16 and the --prompts-csv"),
], ids=["partial-arrival-column", "csv-arrivals+rate", "requests-vs-rows", "prefix-twice"])
def test_csv_contradictions_are_refused(tmp_path, capsys, rows, extra, words):
    """A CSV that another option would silently override, or cycle, is refused."""
    csv = tmp_path / "w.csv"
    csv.write_text(rows)
    assert words in _refused([*RUN, "--prompts-csv", str(csv), *extra], capsys)


def test_arrivals_and_csv_rows_set_the_request_count(tmp_path, capsys):
    """Without --requests, --arrivals times and CSV rows each give one request."""
    import json

    assert main([*RUN, "--prompt", "256", "--arrivals", "0,0.5,1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 3
    csv = tmp_path / "w.csv"
    csv.write_text("prompt,prefix\n256,0\n512,16\n")
    assert main([*RUN, "--prompts-csv", str(csv), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 2


def test_sweep_prefix_above_a_prompt_is_refused(capsys):
    """`pdsim sweep --prefix` above the smallest --prompts value is refused, not clamped."""
    err = _refused(["sweep", "--prompts", "64,128", "--prefix", "96", "--chunks", "64",
                    "--quiet"], capsys)
    assert "smallest 64" in err


def test_default_mode_is_chunk_like_pdgpu(capsys):
    """Without --mode, `pdsim run` hands off per chunk (pdgpu run's default too)."""
    import json

    assert main([*RUN, "--prompt", "1024", "--chunk", "256", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["mode"] == "chunk" and metrics["spans"] == 4


def test_readme_timeline_example_draws_the_mode_it_names(tmp_path, monkeypatch):
    """The README's `pdsim timeline` line draws one copy per 256-token chunk."""
    import re
    import shlex
    from pathlib import Path

    from pdsim.views import timeline

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("pdsim timeline "))
    argv = shlex.split(line.split("#")[0])[1:]
    argv = [str(tmp_path / a) if re.fullmatch(r"t\.(png|json)", a) else a for a in argv]
    drawn = []
    monkeypatch.setattr(timeline, "gantt_png", lambda events, title: drawn.append(events) or b"")
    assert main(argv) == 0
    copies = [e for e in drawn[0] if e.kind == "stage" and e.name == "d2h"]
    assert len(copies) == 8192 // 256
