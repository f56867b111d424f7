"""Ctrl-C and SIGTERM, handled alike: one line, exit 130 (SIGINT) or 143 (SIGTERM).

The first signal raises KeyboardInterrupt (Terminated for SIGTERM) where the main thread is;
the run then aborts its live requests so the trace closes legal. Later signals are ignored:
a terminal's Ctrl-C reaches every process of the group, and a second one (or a SIGTERM from a
supervisor behind it) landing inside that cleanup would leave a traceback and a half-written
trace. The process then ends with os._exit after stopping its children: an interpreter exit
runs torch's C++ destructors while gloo's threads still block, which aborts (exit 134,
"terminate called without an active exception").
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager, suppress


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (exit 143 instead of 130)."""


_received: list[int] = []  # the first signal's number, once one came


def _first_signal(signum, frame) -> None:
    if _received:
        return  # the clean-up of the first one is running: let it finish
    _received.append(signum)
    raise error_for(signum)


def error_for(signum: int) -> KeyboardInterrupt:
    """What signal `signum` raises: Terminated for SIGTERM, KeyboardInterrupt otherwise."""
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def received() -> KeyboardInterrupt | None:
    """The interrupt a signal raised, if one came: an import that swallows every exception
    (a bare `except:` in a dependency) must not make it as if none had."""
    return error_for(_received[0]) if _received else None


def install() -> dict:
    """Both signals raise once in the main thread (before torch loads: a signal while it
    imports is one line too); the handlers they had, for `restore`."""
    return {sig: signal.signal(sig, _first_signal) for sig in (signal.SIGINT, signal.SIGTERM)}


def restore(previous: dict) -> None:
    """The handlers from before `install` (a caller in the same process keeps its own)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    _received.clear()


@contextmanager
def held():
    """SIGINT and SIGTERM held back while the block runs (only recorded), then delivered to
    the handlers from before: for a step that must not be cut in two, like a producer's
    start, whose pid is recorded only at its end (an interrupt inside lost the process, left
    to wait out its rendezvous). Python runs handlers in the main thread whichever thread
    the kernel signals, so replacing them holds the signal, where a thread's mask does not;
    off the main thread (no handler can be set there) the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def exit_code(error: BaseException) -> int:
    return 143 if isinstance(error, Terminated) else 130


def describe(error: BaseException) -> str:
    return "terminated (SIGTERM)" if isinstance(error, Terminated) else "interrupted (Ctrl-C)"


def behind(error: BaseException) -> KeyboardInterrupt | None:
    """The interrupt an error was raised while handling, if any: a clean-up that the signal
    cut short (a thread it stopped mid-start cannot be joined) is still that interrupt."""
    seen = error.__context__
    while seen is not None and not isinstance(seen, KeyboardInterrupt):
        seen = seen.__context__
    return seen


def unmasked(command, args) -> int:
    """command(args); an error from a clean-up that an interrupt cut short (a thread stopped
    mid-start cannot be joined, a link half made) is raised as that interrupt. A broken
    rule the audit found before the stop is no clean-up's error: it stays the run's."""
    from pdgpu.audit import Disagreement
    from pdref.violations import Violation
    try:
        return command(args)
    except (Violation, Disagreement):
        raise
    except Exception as e:
        stop = behind(e)
        if stop is None:
            raise
        raise stop from None


def report(error: KeyboardInterrupt, what: str) -> int:
    """One line on stderr; the exit code."""
    print(f"pdgpu: {describe(error)}: {what}", file=sys.stderr)
    return exit_code(error)


def finish(code: int) -> None:
    """End now, without the interpreter's exit: every child stopped first (a signal may land
    before the code that would stop them holds their handles)."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=3)
    stop_helpers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_helpers() -> None:
    """multiprocessing's forkserver and resource tracker, if this process started them, end
    before it does (left to notice their parent gone, the forkserver outlived an interrupted
    run by up to its own torch import). The forkserver is killed (it may be importing and
    deaf to its pipe; the producers it forked are gone already), the tracker asked to stop
    (it removes what a killed producer left registered); both are waited for."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        with suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()
    resource_tracker._resource_tracker._stop()
