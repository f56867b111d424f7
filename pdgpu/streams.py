"""Marks and lanes: where the copier's work runs and how its completion is known.

Part of the copier (with copier.py, the only modules of pdgpu that know streams, events and
pinned memory).

A *backend* builds the lanes of a producer/decoder pair and the staging rings, and marks
readiness on the producer's compute stream.
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
import os
import queue
import threading
import time
from collections.abc import Callable

import attrs
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


@attrs.frozen
class Ring:
    """The preallocated buffers of one staging slot: gather (producer), host, landing (decoder)."""

    gather: torch.Tensor  # [span_elems] on the producer device
    host: torch.Tensor  # [span_elems] host staging (pinned on CUDA)
    landing: torch.Tensor  # [span_elems] on the decoder device (the host buffer on CPU)

    @property
    def nbytes(self) -> int:
        bufs = {id(b): b for b in (self.gather, self.host, self.landing)}
        return sum(b.numel() * b.element_size() for b in bufs.values())


def pin_host(memory: torch.Tensor) -> None:
    """Page-lock host memory torch did not allocate (a shared mapping), so copies between it
    and a GPU run at pinned-copy speed (DMA, no bounce through a pageable staging buffer)."""
    nbytes = memory.numel() * memory.element_size()
    portable = 1  # cudaHostRegisterPortable: pinned for every device's context, not only the
    # calling thread's current one (a transport's receiving thread may not have set it)
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), nbytes,
                                                                portable))


def unpin_host(memory: torch.Tensor) -> None:
    """Undo pin_host before the mapping goes."""
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(memory.data_ptr()))


STAGES = (("gather", "producer"), ("d2h", "link.d2h"), ("h2d", "link.h2d"))


@contextlib.contextmanager
def compute_threads(device, threads: int | None):
    """Torch intra-op threads for the run; on a CPU producer by default one core fewer than
    the machine has, so the copy lanes get a core (at least one either way).
    Oversubscribed OpenMP teams stall for hundreds of ms on a busy box."""
    if threads is None and torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Backend:
    """The lanes of a producer/decoder pair and how readiness is marked on the producer."""

    def __init__(self, producer, decoder, clock: Callable[[], float], link_gbps) -> None:
        self.producer, self.decoder = torch.device(producer), torch.device(decoder)
        self.clock, self.cuda = clock, self.producer.type == "cuda"
        if self.cuda:
            self.times = {d: EventClock(d, clock) for d in {self.producer, self.decoder}
                          if d.type == "cuda"}
            copy_stream = torch.cuda.Stream(device=self.producer)
        self.lanes = {name: self._lane(name, link_gbps, copy_stream if self.cuda else None)
                      for name, _ in STAGES}

    def _lane(self, name: str, link_gbps, copy_stream) -> Lane:
        paced = link_gbps if name != "gather" else None
        device = self.decoder if name == "h2d" else self.producer
        if device.type != "cuda":
            return HostLane(name, self.clock, paced)
        stream = copy_stream if name != "h2d" else torch.cuda.Stream(device=device)
        return CudaLane(name, self.clock, paced, stream, self.times[device])

    def mark_ready(self) -> Mark:
        """Everything the producer computed so far: a CUDA event on the compute stream (no
        host wait), or done at once on CPU (compute there is synchronous)."""
        if not self.cuda:
            return HostMark.now(self.clock)
        return record(torch.cuda.current_stream(self.producer), self.times[self.producer])

    def host_buffer(self, elems: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(elems, dtype=dtype, pin_memory=self.cuda)

    def make_ring(self, elems: int, dtype: torch.dtype) -> Ring:
        host = self.host_buffer(elems, dtype)
        gather_buf = torch.empty(elems, dtype=dtype, device=self.producer)
        landing = host if self.decoder.type == "cpu" else torch.empty(
            elems, dtype=dtype, device=self.decoder)
        return Ring(gather_buf, host, landing)

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()
