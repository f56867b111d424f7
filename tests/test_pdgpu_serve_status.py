"""pdgpu serve's stderr when it is not a terminal: one line per producer death, restart and
rejoin, and a progress line every --progress-every seconds (pdgpu/serve/status.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

from serve_helpers import kill, producers_alive

from pdgpu.serve.status import PREFIX, LineProgress

HOUR = 3600.0  # a progress interval no test waits for: lines come from line() itself


def test_progress_line_before_the_decoder_exists_says_it_is_starting():
    """Before the rendezvous and models are done, the line counts requests and says so."""
    progress = LineProgress(6, SimpleNamespace(decoder=None, ledger=None), HOUR)
    progress.update(2)
    try:
        assert progress.line().startswith("2/6 requests done (starting, ")
    finally:
        progress.close()


def test_progress_line_counts_requests_and_tokens_with_their_rate():
    """Serving: requests done of all, every request's tokens so far, tokens/s since t = 0."""
    tracked = {"r0": SimpleNamespace(output=[1, 2, 3]), "r1": SimpleNamespace(output=[4])}
    run = SimpleNamespace(decoder=SimpleNamespace(tracked=tracked),
                          ledger=SimpleNamespace(now=lambda: 2.0))
    progress = LineProgress(2, run, HOUR)
    progress.update()
    try:
        assert progress.line() == "1/2 requests done, 4 tokens, 2.0 tokens/s over 2.0 s"
    finally:
        progress.close()


def test_a_killed_and_restarted_producer_and_progress_are_logged_off_a_terminal(tmp_path):
    """stderr piped: the kill's death, the restart and the rejoin are one line each, progress
    lines come, and nothing else (no traceback) is written."""
    argv = [sys.executable, "-m", "pdgpu", "serve", "--model", "tiny", "--producers", "2",
            "--requests", "40", "--concurrency", "4", "--prompt-range", "33:64",
            "--output-tokens", "2", "--chunk", "16", "--link-gbps", "0.0005",
            "--kill-producer", "0@0.3", "--restart-producers", "--progress-every", "0.2",
            "--connect-timeout", "60", "--json"]
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    finally:
        kill(producers_alive())
    assert run.returncode == 0, run.stderr
    summary, lines = json.loads(run.stdout), run.stderr.splitlines()
    assert summary["producer_deaths"] == summary["producer_restarts"] == 1, summary
    assert all(line.startswith(PREFIX) for line in lines), run.stderr
    said = [line.removeprefix(PREFIX) for line in lines]
    assert sum(s.startswith("producer p1 declared dead: ") for s in said) == 1, said
    assert "producer p1 restarting (generation 1)" in said
    assert "producer p1 rejoined (generation 1): serving" in said
    assert any(s.endswith(" s") and "/40 requests done" in s for s in said), said
