"""Waiting on another thread in tests without asserting on time (a stuck wait is bounded by
the test's own timeout, pytest-timeout)."""

from __future__ import annotations

import threading


def wait_for(condition, polls: int = 20000) -> None:
    """Poll `condition` every millisecond, `polls` times at most (a few seconds)."""
    pause = threading.Event()
    for _ in range(polls):
        if condition():
            return
        pause.wait(0.001)
