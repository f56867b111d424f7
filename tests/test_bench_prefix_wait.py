"""bench/prefix_wait.py runs: a waiting prompt's turns hash nothing (its kept key chain)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "prefix_wait.py"


def test_a_waiting_turn_hashes_nothing_on_either_side():
    """A 512-token prompt, half cached, 3 turns: its JSON line, 0 hashes a turn both sides."""
    done = subprocess.run([sys.executable, str(BENCH), "--prompt", "512", "--cached", "256",
                           "--turns", "3"], capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["producer_hashes_per_turn"] == out["decoder_hashes_per_turn"] == 0
    assert out["producer_turn_us"] > 0 and out["decoder_turn_us"] > 0


def test_a_cached_part_as_long_as_the_prompt_is_refused():
    """--cached must be shorter than --prompt: one line, exit 2."""
    done = subprocess.run([sys.executable, str(BENCH), "--prompt", "64", "--cached", "64"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "need 0 < --cached < --prompt" in done.stderr
    assert "Traceback" not in done.stderr
