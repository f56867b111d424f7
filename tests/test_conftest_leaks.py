"""The leak check every test runs under (conftest.py's `no_leaks`, leak_helpers.py): what a
test started and left running is named, what ended by itself is not, and a test that leaves a
thread, or the process's state changed, fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import leak_helpers
import pytest
from leak_helpers import changed_state, leaks, process_state, snapshot

HERE = Path(__file__).parent
GRACE_S = 0.05  # the checks below wait on blocked threads: a short grace changes nothing


def test_a_thread_left_running_is_named():
    """A thread started after the snapshot and still blocked is reported by its name."""
    release = threading.Event()
    before = snapshot()
    thread = threading.Thread(target=release.wait, args=(60,), name="left-behind", daemon=True)
    thread.start()
    try:
        assert leaks(before, GRACE_S) == ["thread 'left-behind'"]
    finally:
        release.set()
        thread.join(10)


def test_a_thread_that_ends_within_the_grace_is_not_a_leak():
    """A thread that finishes by itself (joined within the grace) is not reported."""
    before = snapshot()
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(60,), name="ends-soon")
    thread.start()
    release.set()
    assert leaks(before) == []
    assert not thread.is_alive()


@pytest.mark.parametrize("listed", [True, False])
def test_a_child_process_left_running_is_named(monkeypatch, listed):
    """A child process started after the snapshot and still running is reported by pid,
    found through /proc's `children` lists or, without them, a scan of every process."""
    if listed and not leak_helpers.PROC_CHILDREN:
        pytest.skip("this kernel has no /proc/PID/task/TID/children")
    monkeypatch.setattr(leak_helpers, "PROC_CHILDREN", listed)
    before = snapshot()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        found = leaks(before, GRACE_S)
        assert len(found) == 1 and found[0].startswith(f"process {child.pid} ("), found
    finally:
        child.kill()
        child.wait(10)
    assert leaks(before, GRACE_S) == []  # reaped: gone


def _inner_run(folder: Path, source: str, **env) -> subprocess.CompletedProcess:
    """pytest in a subprocess on `source` (test_inner.py) beside copies of this folder's
    conftest.py and leak_helpers.py; `env` added to its environment."""
    for name in ("conftest.py", "leak_helpers.py"):
        (folder / name).write_text((HERE / name).read_text())
    (folder / "test_inner.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_inner.py"], cwd=folder, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_a_test_that_leaves_a_thread_fails(tmp_path):
    """Under this folder's conftest, a test leaving a thread errors at teardown naming it and
    the test; its neighbour that joins its thread passes."""
    run = _inner_run(tmp_path, (
        "import threading\n\n"
        "def test_leaves_a_thread():\n"
        "    threading.Thread(target=threading.Event().wait, args=(60,), name='left-behind',\n"
        "                     daemon=True).start()\n\n"
        "def test_joins_its_thread():\n"
        "    thread = threading.Thread(target=lambda: None)\n"
        "    thread.start()\n"
        "    thread.join()\n"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "test_inner.py::test_leaves_a_thread left running: thread 'left-behind'" in run.stdout
    assert "ERROR test_inner.py::test_leaves_a_thread" in run.stdout
    assert "2 passed, 1 error" in run.stdout, run.stdout  # (its body passed; teardown errs)


def test_changed_state_names_each_change_and_nothing_once_restored():
    """An environment variable set and one changed, a signal handler replaced and torch's
    thread count changed are each named; once each is put back, nothing is."""
    import torch
    before = process_state()
    threads, handler = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    os.environ["PD_LEAK_PROBE"] = "1"
    torch.set_num_threads(threads + 1)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        changes = changed_state(before)
        assert changes[0] == "$PD_LEAK_PROBE None -> '1'" and len(changes) == 3, changes
        assert any(c.startswith("SIGTERM handler") for c in changes)
        assert f"torch threads {threads} -> {threads + 1}" in changes
    finally:
        del os.environ["PD_LEAK_PROBE"]
        torch.set_num_threads(threads)
        signal.signal(signal.SIGTERM, handler)
    assert changed_state(before) == []


def test_a_test_that_leaves_the_environment_changed_fails(tmp_path):
    """Under this folder's conftest, a test that sets a variable and leaves it errors at
    teardown naming it; one that sets it through monkeypatch (undone) passes."""
    run = _inner_run(tmp_path, (
        "import os\n\n"
        "def test_leaves_a_variable():\n"
        "    os.environ['PD_LEFT'] = 'x'\n\n"
        "def test_restores_it(monkeypatch):\n"
        "    monkeypatch.setenv('PD_RESTORED', 'y')\n"), PD_LEFT="was")
    assert "test_inner.py::test_leaves_a_variable left changed: $PD_LEFT 'was' -> 'x'" \
        in run.stdout, run.stdout + run.stderr
    assert "2 passed, 1 error" in run.stdout, run.stdout
