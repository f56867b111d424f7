"""a100-pcie under the seed-eager engine against the reference figures in specs/contract.md
(its calibration: every run here is pinned to that engine)."""

import pytest

from pdsim.cli import main

BRIEF_BYTES = 939_524_096
BRIEF_HANDOFF_S = 0.99798
BRIEF_TAIL_S = 0.05561
BRIEF_EXPORT_4G_S = 0.25360


def run_json(capsys, *argv) -> dict:
    import json

    assert main(["run", "--json", "--engine", "seed-eager", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def whole(capsys):
    return run_json(capsys, "--model", "qwen3-0.6b", "--hw", "a100-pcie", "--mode", "whole",
                    "--prompt", "8192", "--chunk", "256")


def test_whole_copy_bytes_exact(whole):
    """Whole copy of 8192 Qwen3-0.6B tokens moves exactly BRIEF's byte count."""
    assert whole["bytes"] == BRIEF_BYTES


def test_whole_copy_handoff_within_2pct(whole):
    """Prefill + handoff is within 2% of BRIEF's 997.98 ms."""
    assert whole["handoff_s"] == pytest.approx(BRIEF_HANDOFF_S, rel=0.02)


def test_whole_copy_tail_within_2pct(whole):
    """The unhidden tail is within 2% of BRIEF's 55.61 ms."""
    assert whole["tail_s"] == pytest.approx(BRIEF_TAIL_S, rel=0.02)


def test_export_only_4gib_within_10pct(capsys):
    """Export-only whole copy of a 4 GiB payload is within 10% of BRIEF's 253.60 ms."""
    out = run_json(capsys, "--no-compute", "--payload", str(4 * 2**30), "--mode", "whole")
    assert out["handoff_s"] == pytest.approx(BRIEF_EXPORT_4G_S, rel=0.10)


def test_chunked_export_slower_than_whole(capsys):
    """Without compute to hide behind, chunked export pays per-span costs and is slower."""
    whole = run_json(capsys, "--no-compute", "--payload", str(4 * 2**30), "--mode", "whole")
    chunk = run_json(capsys, "--no-compute", "--payload", str(4 * 2**30), "--mode", "chunk")
    assert chunk["handoff_s"] > whole["handoff_s"] * 1.02


def test_chunk_mode_hides_most_of_the_tail(capsys):
    """With compute to hide behind, chunk mode's tail is a small fraction of whole mode's."""
    chunk = run_json(capsys, "--mode", "chunk", "--prompt", "8192", "--chunk", "256")
    assert chunk["tail_s"] < BRIEF_TAIL_S / 10
    assert chunk["peak_staging_bytes"] <= 2 * 256 * 114_688
