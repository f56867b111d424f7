"""pdref.outfile: atomic output files get ordinary modes (0666 less the umask), not 0600."""

from __future__ import annotations

import contextlib
import os
import stat

import pytest

from pdref.outfile import write_atomic


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask,want", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_file_has_the_mode_open_would_give(tmp_path, mask, want):
    """Mode is 0666 & ~umask, as `open(path, "w")` would make it."""
    with _umask(mask):
        write_atomic(tmp_path / "out.txt", "x\n")
    assert _mode(tmp_path / "out.txt") == want
    assert (tmp_path / "out.txt").read_text() == "x\n"


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    """A write that fails midway keeps the previous file and removes its temporary."""
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_atomic(path, 12345)  # not bytes or str: fails after the temporary exists
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_pdsim_outputs_are_0644_under_umask_022(tmp_path):
    """`pdsim sweep --csv --json` and `pdsim timeline --png --perfetto` write 0644 files."""
    from pdsim.cli import main

    sweep = ["sweep", "--prompts", "512", "--chunks", "256", "--modes", "chunk", "--quiet",
             "--csv", str(tmp_path / "s.csv"), "--json", str(tmp_path / "s.json")]
    timeline = ["timeline", "--prompt", "512", "--chunk", "256", "--mode", "chunk",
                "--png", str(tmp_path / "t.png"), "--perfetto", str(tmp_path / "t.json")]
    with _umask(0o022):
        assert main(sweep) == 0
        assert main(timeline) == 0
    for name in ("s.csv", "s.json", "t.png", "t.json"):
        assert _mode(tmp_path / name) == 0o644, name


def test_traces_of_both_shells_are_0644_under_umask_022(tmp_path):
    """`pdsim run --trace` and `pdgpu run --trace` (pdref's TraceWriter) write 0644 files."""
    from pdgpu.cli import main as pdgpu_main
    from pdsim.cli import main as pdsim_main

    with _umask(0o022):
        assert pdsim_main(["run", "--prompt", "256", "--trace", str(tmp_path / "sim.jsonl")]) == 0
        assert pdgpu_main(["run", "--prompt", "32", "--chunk", "16",
                           "--trace", str(tmp_path / "engine.jsonl")]) == 0
    assert _mode(tmp_path / "sim.jsonl") == _mode(tmp_path / "engine.jsonl") == 0o644
