"""The full specification behind the engine's fast mirror, off the critical path.

The engine decides and gets its verdict on each event from pdref's `FastMonitor` (the
mutable mirror) on its own thread; every accepted event, and every answer the mirror gave to
a query the engine decided with, is also put on a queue that one audit thread replays into
the specification's `Monitor` (`apply`). A refusal there (the same Violation, code and
message, the synchronous check would have raised) or an answer that differs from the
mirror's (`Disagreement`) is kept in `error`; the Recorder raises it at the engine's next
call into pdref, so nothing more is freed, written or admitted once it is found.

Bounded delay: the backlog never exceeds `bound` items (past it, the emitting thread waits
for the audit to catch up), so at most `bound` events go out after the one the audit refuses.
A thread, not a process: the audit's work per event is tens of microseconds, most of it
while the engine thread is inside torch with the GIL released; pickling every event to
another process would cost the engine thread about as much as the mirror's check itself.
The thread wakes every PERIOD_S (or when the backlog passes the bound), not per event: a
queue that woke it at each event made the emitting thread hand over the GIL there, and
cost back most of what the mirror saves (export-only chunked `small` on 2 cores, median of
12: live checks 0.97 ms a run with a wake per event, 0.75 ms batched, 0.82 ms with no audit
at all, 1.25 ms with the Monitor in line). The lag is then about PERIOD_S.
"""

from __future__ import annotations

import statistics
import threading
import time
from array import array
from collections import deque

from pdref.monitor import Monitor
from pdref.violations import Violation

BOUND = 256  # most items waiting for the audit; past it the engine waits (backpressure)
PERIOD_S = 0.002  # the audit wakes this often (not per event: see Audit)
DRAIN_S = 60.0  # longest wait for the audit at the end of a run
_STOP = None


class Disagreement(RuntimeError):
    """The fast mirror and the specification answered differently: the run stops."""


class Audit:
    """The audit thread, its Monitor, its queue, the lag of every item and the first error."""

    def __init__(self, header, monitor_cls=Monitor, bound: int = BOUND) -> None:
        self.monitor = monitor_cls(header)  # no sink: the trace is the fast mirror's
        self.bound = bound
        self.error: Exception | None = None
        self.lags = array("d")  # seconds from each item's emission to its audit (8 B each)
        self.busy_s = 0.0  # audit-thread seconds inside the Monitor
        self.waits = 0  # times an emitting thread waited for the backlog to shrink
        self.drain_s = 0.0  # seconds the end of the run waited for the audit
        self._items: deque = deque()  # append and popleft are atomic: no lock
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdref-audit", daemon=True)
        self._thread.start()

    def put(self, name: str, args: tuple, answer, emitted: float) -> None:
        """The mirror answered `answer` to `name(*args)` at perf time `emitted` (an accepted
        event: `emit` answered None); the Monitor must answer the same."""
        self._items.append((name, args, answer, emitted))
        if len(self._items) > self.bound:
            self._catch_up()

    def _catch_up(self) -> None:
        """Wait (polling: rare) until half the backlog is audited, or raise what it found."""
        self.waits += 1
        self._wake.set()
        while len(self._items) > self.bound // 2 and self.error is None:
            time.sleep(0.0005)
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        items = self._items
        while True:
            self._wake.wait(PERIOD_S)
            self._wake.clear()
            while items:
                item = items.popleft()
                if item is _STOP:
                    return
                if self.error is None:  # after the first error: only drain
                    self._audit(*item)

    def _audit(self, name: str, args: tuple, answer, emitted: float) -> None:
        start = time.perf_counter()
        try:
            got = self._ask(name, args)
            if not _same(got, answer):
                raise Disagreement(f"pdref's Monitor answers {name}{args!r} with {got!r}, the "
                                   f"fast mirror answered {answer!r}")
        except (Violation, Disagreement) as e:
            self.error = e
        except Exception as e:  # noqa: BLE001 - any other failure of the audit stops the run too
            self.error = Disagreement(f"the audit of {name}{args!r} failed: {e!r}")
        end = time.perf_counter()
        self.busy_s += end - start
        self.lags.append(end - emitted)

    def _ask(self, name: str, args: tuple):
        if name == "state":  # the end of the run: the whole state, compared once
            return self.monitor.state
        return getattr(self.monitor, name)(*args)

    def finish(self, timeout: float = DRAIN_S) -> None:
        """Wait (at most `timeout`) until every item is audited, then raise what was found."""
        found = self.drain(timeout)
        if found is not None:
            raise found


    def drain(self, timeout: float = DRAIN_S) -> Exception | None:
        """Wait (at most `timeout`) until every item queued so far is audited; what the audit
        found (None: nothing). A run that stops early drains too, so a violation the audit
        would find in what happened before the stop is never lost behind the stop."""
        start = time.perf_counter()
        self.stop()
        self._thread.join(timeout)
        self.drain_s += time.perf_counter() - start
        if self._thread.is_alive() and self.error is None:
            self.error = Disagreement(f"the audit did not finish within {timeout} s of the "
                                      "run's end")
        return self.error

    def stop(self) -> None:
        """Let the thread end once it reaches this point of the queue (idempotent)."""
        self._items.append(_STOP)
        self._wake.set()

    def metrics(self) -> dict:
        lags = self.lags
        return {"audit_s": self.busy_s, "audit_items": len(lags),
                "audit_lag_max_s": max(lags, default=0.0),
                "audit_lag_p50_s": statistics.median(lags) if lags else 0.0,
                "audit_waits": self.waits, "audit_drain_s": self.drain_s}


def _same(got, answer) -> bool:
    """Equal answers; page and span id tuples as sets (each side lists them in its order)."""
    if type(got) is tuple and type(answer) is tuple:  # (a state is a tuple subclass)
        return sorted(got) == sorted(answer)
    return got == answer


def cause(error: BaseException, found: Exception | None) -> BaseException:
    """What stopped a run that raised `error` while its audit found `found` (None: nothing):
    the audit's finding is the earlier event (every call into pdref asks for it first), so
    it is the run's first broken rule, and the cause."""
    return error if found is None else found
