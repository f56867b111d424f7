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


def in_thread(target):
    """Start `target` on a daemon thread; the returned `finish()` joins it and re-raises on the
    test's thread whatever it raised (raised on its own thread, it would be a mere warning)."""
    raised = []

    def run():
        try:
            target()
        except BaseException as e:  # handed back to the test's thread by finish()
            raised.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def finish():
        thread.join(180)
        assert not thread.is_alive(), "the background step never finished"
        if raised:
            raise raised[0]
    return finish


def wait_until(condition, what: str, deadline_s: float = 120.0, poll_s: float = 0.05) -> None:
    """Poll `condition` until it holds; fail naming `what` after a generous deadline (a
    loaded machine is slow, never this slow)."""
    import time
    end = time.monotonic() + deadline_s
    pause = threading.Event()
    while not condition():
        assert time.monotonic() < end, f"not seen within {deadline_s:.0f} s: {what}"
        pause.wait(poll_s)
