"""bench/chunk_speed.py's own logic (its engine runs are a benchmark, not a test)."""

import json
import sys
from pathlib import Path

import attrs
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import chunk_speed  # noqa: E402


def test_chunk_times_are_the_compute_stages_only(tmp_path):
    """Every `compute` stage's length, and nothing from other stages or events."""
    rows = [{"kind": "header"}, {"kind": "stage", "name": "compute", "t": 1.0, "end": 1.25},
            {"kind": "stage", "name": "gather", "t": 1.0, "end": 3.0},
            {"kind": "issue", "t": 1.3}, {"kind": "stage", "name": "compute", "t": 2.0, "end": 2.5}]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert chunk_speed.chunk_times(str(trace)) == [0.25, 0.5]


def test_the_pairs_differ_only_in_what_they_compare():
    """mode: the same point as chunk and as whole; pacing: the same point unpaced and paced."""
    chunk, whole = chunk_speed.PAIRS["mode"]
    assert (chunk.mode, whole.mode) == ("chunk", "whole")
    assert attrs.evolve(chunk, mode="whole") == whole
    unpaced, paced = chunk_speed.PAIRS["pacing"]
    assert unpaced.link_gbps is None and paced.link_gbps == 0.05
    assert attrs.evolve(unpaced, link_gbps=0.05) == paced


def test_zero_rounds_is_refused_with_exit_2(capsys):
    """--rounds 0 is one line naming the option, exit 2, no engine run."""
    with pytest.raises(SystemExit) as stop:
        chunk_speed.main(["--rounds", "0"])
    assert stop.value.code == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
