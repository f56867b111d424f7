"""Hypothesis runs without its per-example deadline: CI machines are shared and noisy, and a
slow example says nothing about correctness (speed is measured by bench/, side by side).
Every test has a timeout (pytest-timeout, pyproject.toml): a stuck one fails with its stack.
Every test stops what it starts and restores what it changes: one that leaves a thread or a
process running, or the environment, working directory, signal handlers or torch's thread
count changed, fails (`no_leaks`, leak_helpers.py).
Shared helpers live in this folder's *_helpers.py modules, imported by their plain names: this
folder is put on sys.path here, so any test file collects alone (`pytest tests/FILE.py`), from
any directory, under any import mode."""

import gc
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("noisy-machine", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("noisy-machine")

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import leak_helpers  # noqa: E402 - found through the folder just put on sys.path

SLOW_TIMEOUT_S = 900  # a slow test's own bound (the default, pyproject's `timeout`, is 120 s)


def pytest_collection_modifyitems(items) -> None:
    """A slow test without a timeout of its own gets SLOW_TIMEOUT_S: stuck still fails."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def pytest_collection_finish(session) -> None:
    """What collection loaded (torch, the test modules, their models: most of the process's
    objects, kept to the end) is moved out of the cyclic collector's sight: a full collection
    stops every thread, and over those objects it took 0.3 to 2 s at load 16, a pause that
    timed tests, heartbeats and span deadlines then measured (gc.freeze: later collections
    look at what the tests made)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail the test if a thread or process it started outlives it (after a short grace), or
    if it left the process's state changed (environment, working directory, signal
    handlers, torch's thread count and default dtype). Autouse: torn down after the test's
    own fixtures, so what monkeypatch undoes is undone by then."""
    before, state = leak_helpers.snapshot(), leak_helpers.process_state()
    yield
    left = leak_helpers.leaks(before)
    if left:
        pytest.fail(f"{request.node.nodeid} left running: {', '.join(left)}", pytrace=False)
    changed = leak_helpers.changed_state(state)
    if changed:
        pytest.fail(f"{request.node.nodeid} left changed: {'; '.join(changed)}", pytrace=False)
