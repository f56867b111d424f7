"""The suite cannot hang: a stuck test fails with the stacks of its threads (pytest-timeout,
configured in pyproject.toml), and slow tests get a larger bound of their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STUCK = '''
import threading

def test_stuck():
    threading.Event().wait()  # nobody sets it
'''


def test_the_project_sets_a_thread_timeout_on_every_test(request):
    """The plugin is loaded with the project's default and its stack-printing method."""
    assert request.config.pluginmanager.hasplugin("timeout")
    assert request.config.getini("timeout") == "120"
    assert request.config.getini("timeout_method") == "thread"
    assert request.node.get_closest_marker("timeout") is None  # the default applies here


def test_a_stuck_test_fails_with_its_stack(tmp_path):
    """A test waiting forever, under the project's settings with a 2 s bound, ends the run
    non-zero and prints where it was stuck."""
    (tmp_path / "test_stuck.py").write_text(STUCK)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
         str(tmp_path), "-o", "timeout=2", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Timeout" in out, out
    assert "test_stuck.py" in out and "threading.Event().wait()" in out, out
