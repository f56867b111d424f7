"""Marks and lanes: where the copier's work runs and how its completion is known.

Part of the copier (with copier.py, the only modules of pdgpu that know streams, events and
pinned memory).

A *mark* is a point in some work: done or not, when it was done (the run clock), and an
error if the work failed. A *lane* runs one stage of every span, in issue order, after the
span's previous stage:
- a host lane runs the stage on its own thread (CPU tensors), then marks it done;
- a CUDA lane's thread only enqueues: its stream waits on the previous stage's CUDA event,
  the copy is launched, and an event recorded after it is the mark. Nothing synchronizes the
  host, except when link pacing holds a stage (then the lane thread waits its own event).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable

import torch


class Mark:
    """A point in some work. `error` is set when the work failed (it still completes)."""

    error: str | None = None

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def time(self) -> float:
        """Run-clock seconds at which it completed (once done)."""
        raise NotImplementedError


class HostMark(Mark):
    """Host work: done when `set` is called; its time is the clock then."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock, self._event, self._t = clock, threading.Event(), None

    @classmethod
    def now(cls, clock: Callable[[], float], error: str | None = None) -> HostMark:
        mark = cls(clock)
        mark.set(error)
        return mark

    def set(self, error: str | None = None) -> None:
        self.error, self._t = error, self._clock()
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self) -> None:
        self._event.wait()

    def time(self) -> float:
        return self._t


class EventClock:
    """Run-clock times of CUDA events on one device: an anchor event whose host time is
    known, and `elapsed_time` from it (both events must be complete)."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record(torch.cuda.current_stream(device))
        self.anchor.synchronize()
        self.anchor_abs = time.perf_counter()

    def time_of(self, event) -> float:
        absolute = self.anchor_abs + self.anchor.elapsed_time(event) / 1e3
        return absolute - (time.perf_counter() - self.clock())  # the clock's t0 may move


class CudaMark(Mark):
    """A CUDA event recorded on a stream: done when the stream got past it."""

    def __init__(self, event, times: EventClock, error: str | None = None) -> None:
        self.event, self.times, self.error = event, times, error

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def time(self) -> float:
        return self.times.time_of(self.event)


def record(stream, times: EventClock, error: str | None = None) -> CudaMark:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return CudaMark(event, times, error)


def failed(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Lane:
    """One stage of every span, run in order on this lane's own thread. `run(after, work,
    nbytes)` (on that thread) does the stage after mark `after` and returns its (start, end)
    marks; start is None when the stage was skipped because `after` failed (end is `after`)."""

    def __init__(self, name: str, clock: Callable[[], float], link_gbps: float | None) -> None:
        self.name, self.clock, self.link_gbps = name, clock, link_gbps
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"pdgpu-{name}", daemon=True)
        self._thread.start()

    def put(self, task: Callable[[], None]) -> None:
        """Run `task` on this lane after every task put before it (tasks never raise)."""
        self._tasks.put(task)

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (task := self._tasks.get()) is not None:
            task()

    def _pace(self, start: float, nbytes: int) -> None:
        """Hold the stage until `nbytes` could have crossed a `link_gbps` link from `start`."""
        if self.link_gbps is None or not nbytes:
            return
        remaining = start + nbytes / (self.link_gbps * 1e9) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def context(self):
        """Where work outside the span stages runs on this lane's device (zeroing the pool)."""
        return contextlib.nullcontext()

    def sync(self) -> None:
        return None


class HostLane(Lane):
    """The stage runs here, on this lane's thread, on host tensors."""

    def run(self, after: Mark, work: Callable[[], None], nbytes: int):
        after.wait()
        if after.error is not None:
            return None, after
        start, began = HostMark.now(self.clock), time.perf_counter()
        end = HostMark(self.clock)
        try:
            work()
        except Exception as e:  # reported through the mark, never raised on the lane
            end.set(failed(e))
            return start, end
        self._pace(began, nbytes)
        end.set()
        return start, end


class CudaLane(Lane):
    """The stage is enqueued on `stream` behind the previous stage's event; no host wait
    (a host mark from a host lane before it is waited for on this thread)."""

    def __init__(self, name, clock, link_gbps, stream, times: EventClock) -> None:
        super().__init__(name, clock, link_gbps)
        self.stream, self.times = stream, times

    def context(self):
        return torch.cuda.stream(self.stream)

    def sync(self) -> None:
        self.stream.synchronize()

    def run(self, after: Mark, work: Callable[[], None], nbytes: int):
        if isinstance(after, CudaMark):
            self.stream.wait_event(after.event)
        else:
            after.wait()
        if after.error is not None:
            return None, after
        start = record(self.stream, self.times)
        error = None
        with torch.cuda.stream(self.stream):
            try:
                work()
            except Exception as e:  # the end event follows whatever was enqueued before it
                error = failed(e)
        end = record(self.stream, self.times, error)
        if self.link_gbps is None or error is not None:
            return start, end
        return start, self._paced_end(start, end, nbytes)

    def _paced_end(self, start: CudaMark, end: CudaMark, nbytes: int) -> HostMark:
        """Link pacing: this lane's thread waits the copy, then holds it to bytes / rate;
        the next stage waits for the held (host) mark."""
        start.wait()
        began = time.perf_counter() - (self.clock() - start.time())
        end.wait()
        self._pace(began, nbytes)
        return HostMark.now(self.clock)
