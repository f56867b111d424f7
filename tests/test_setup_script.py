"""scripts/setup.sh: a failed compile of the simulator's modules fails set-up loudly, unless
pure Python was asked for (PD_PURE_PYTHON=1), which skips the compile."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# An interpreter that logs its arguments and succeeds at everything but the compile, so
# set-up runs every step without installing anything.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$*" in
    *build_compiled.py*) echo "build_compiled: failed (CompileError: no cc)" >&2; exit 1;;
esac
"""


def _setup(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run set-up on the fake interpreter; its result and the interpreter's calls."""
    fake, calls = tmp_path / "python", tmp_path / "calls"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "PD_PURE_PYTHON"}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True,
                         text=True, timeout=60,
                         env={**base, "PYTHON": str(fake), "CALLS": str(calls), **env})
    return run, calls.read_text()


def test_a_failed_compile_fails_setup_loudly(tmp_path):
    """The compile fails: set-up exits 1 and says so, naming the way to pure Python."""
    run, calls = _setup(tmp_path)
    assert "build_compiled.py" in calls
    assert run.returncode == 1, run.stdout
    assert "FAILED to compile" in run.stderr and "PD_PURE_PYTHON=1" in run.stderr


def test_pure_python_setup_skips_the_compile(tmp_path):
    """PD_PURE_PYTHON=1: no compile is tried, set-up succeeds and says why."""
    run, calls = _setup(tmp_path, PD_PURE_PYTHON="1")
    assert run.returncode == 0, run.stderr
    assert "build_compiled.py" not in calls and "-e .[dev]" in calls
    assert "PD_PURE_PYTHON is set" in run.stdout


def test_setup_prints_each_step_with_its_seconds(tmp_path):
    """venv, torch, project and compile each end with a line giving their seconds."""
    run, _ = _setup(tmp_path, PD_PURE_PYTHON="1")
    assert run.returncode == 0, run.stderr
    for step in ("1/4 venv", "2/4 torch", "3/4 project", "4/4 compile", "total"):
        assert re.search(rf"^setup: \[{step}\] .* in \d+\.\d s$", run.stdout, re.M), run.stdout
