"""Simulator speed targets of issue 3 (slow: run with -m slow)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


@pytest.mark.slow
def test_ten_thousand_config_sweep_under_a_minute():
    """A 10,000-config sweep of 8192-token prompts (chunk 64..2048) takes under 60 s."""
    import sim_speed

    figures = sim_speed.sweep_speed(sim_speed.base_config(), 10_000, jobs=2)
    assert figures["configs"] == 10_000 and figures["wall_s"] < 60
