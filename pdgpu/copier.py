"""The copy worker: the only module of pdgpu that knows streams, events and pinned memory.

One worker thread per producer runs every span through the same stages:
  wait the span's readiness marker -> gather (index the span out of the source pages into a
  preallocated buffer) -> d2h (into one of `slots` host staging buffers) -> h2d (into the
  decoder pool's slab, paced to `link_gbps` when set) -> report a `CopyResult`.
On CUDA the stages run on dedicated copy streams (producer side and decoder side), readiness
is a CUDA event recorded on the compute stream after each chunk, staging is pinned, and each
stage is timed by synchronizing its stream. On CPU the same thread does the same copies, so
overlap with the compute thread is real. Every buffer is allocated once, up front.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import attrs
import torch

from pdgpu.decoder_pool import DecoderPool, Slab
from pdgpu.source_cache import gather
from pdref.intervals import Range, length


class CopyFault(RuntimeError):
    """The injected failure of one copy (fault injection)."""


@attrs.frozen
class CopyJob:
    """One span to move: source region of a request into its decoder slab."""

    span: int
    req: str
    layers: Range
    tokens: Range
    src_slots: torch.Tensor  # [prompt] source slot per position
    slab: Slab
    ready: object  # a readiness marker from `Copier.mark_ready`
    fail: bool = False


@attrs.frozen
class StageTime:
    name: str
    start: float
    end: float
    resource: str


@attrs.frozen
class CopyResult:
    job: CopyJob
    error: str | None
    stages: tuple[StageTime, ...]


@attrs.frozen
class CopierConfig:
    slots: int  # staging buffers in the ring (= the spans that may be in flight)
    span_elems: int  # elements of the largest span: each buffer's size
    link_gbps: float | None = None  # pace h2d to this many GB/s (1e9 bytes/s)


class CpuBackend:
    """Host-only structure: readiness is a threading.Event, streams are no-ops."""

    def __init__(self, producer: torch.device, decoder: torch.device) -> None:
        self.producer, self.decoder = producer, decoder

    def mark_ready(self) -> threading.Event:
        ready = threading.Event()
        ready.set()  # compute on this thread is synchronous: done when we get here
        return ready

    def wait_ready(self, ready: threading.Event) -> None:
        ready.wait()

    def producer_stream(self):
        return contextlib.nullcontext()

    def decoder_stream(self):
        return contextlib.nullcontext()

    def sync_producer(self) -> None:
        return None

    def sync_decoder(self) -> None:
        return None

    def host_buffer(self, elems: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(elems, dtype=dtype)


class CudaBackend(CpuBackend):
    """Dedicated copy streams, CUDA readiness events, pinned host staging."""

    def __init__(self, producer: torch.device, decoder: torch.device) -> None:
        super().__init__(producer, decoder)
        self.copy_stream = torch.cuda.Stream(device=producer)
        self.import_stream = torch.cuda.Stream(device=decoder) if decoder.type == "cuda" else None

    def mark_ready(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.producer))
        event.synchronize()  # `computed` and the compute stage's end must be true on the host
        return event

    def wait_ready(self, ready: torch.cuda.Event) -> None:
        self.copy_stream.wait_event(ready)

    def producer_stream(self):
        return torch.cuda.stream(self.copy_stream)

    def decoder_stream(self):
        if self.import_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.import_stream)

    def sync_producer(self) -> None:
        self.copy_stream.synchronize()

    def sync_decoder(self) -> None:
        if self.import_stream is not None:
            self.import_stream.synchronize()

    def host_buffer(self, elems: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(elems, dtype=dtype, pin_memory=True)


@contextlib.contextmanager
def compute_threads(device, threads: int | None):
    """Torch intra-op threads for the run; on a CPU producer by default one core fewer than
    the machine has, so the copy worker gets a core of its own (at least one either way).
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


def make_backend(producer, decoder) -> CpuBackend:
    producer, decoder = torch.device(producer), torch.device(decoder)
    if "cuda" in (producer.type, decoder.type):
        return CudaBackend(producer, decoder)
    return CpuBackend(producer, decoder)


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


def _make_ring(backend: CpuBackend, elems: int, dtype: torch.dtype) -> Ring:
    host = backend.host_buffer(elems, dtype)
    gather_buf = torch.empty(elems, dtype=dtype, device=backend.producer)
    landing = host if backend.decoder.type == "cpu" else torch.empty(
        elems, dtype=dtype, device=backend.decoder)
    return Ring(gather_buf, host, landing)


class Copier:
    """One copy worker thread for one producer; the engine submits jobs and harvests results."""

    def __init__(self, config: CopierConfig, source_kv: torch.Tensor, pool: DecoderPool,
                 clock: Callable[[], float]) -> None:
        self.config, self.source_kv, self.pool, self.clock = config, source_kv, pool, clock
        self.backend = make_backend(source_kv.device, pool.device)
        self.rings = [_make_ring(self.backend, config.span_elems, source_kv.dtype)
                      for _ in range(config.slots)]
        self._free = deque(range(config.slots))
        self._busy: dict[int, int] = {}  # span -> ring slot
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="pdgpu-copier", daemon=True)
        self._thread.start()

    @property
    def staging_bytes(self) -> int:
        """Bytes of every staging buffer the scheme allocated (all rings, all sides)."""
        return sum(r.nbytes for r in self.rings)

    @property
    def source_side_bytes(self) -> int:
        """Bytes the scheme allocates on the producer side: gather and host staging buffers."""
        bufs = {b.data_ptr(): b for r in self.rings for b in (r.gather, r.host)}
        return sum(b.numel() * b.element_size() for b in bufs.values())

    @property
    def host_staging_bytes(self) -> int:
        """Bytes of the host staging ring (pinned on CUDA): `slots` spans."""
        return sum(r.host.numel() * r.host.element_size() for r in self.rings)

    @property
    def in_flight(self) -> int:
        return len(self._busy)

    def mark_ready(self):
        """Record readiness of everything computed so far (call after each compute step)."""
        return self.backend.mark_ready()

    def submit(self, job: CopyJob) -> None:
        if not self._free:
            raise RuntimeError("copier: every staging buffer is in use (max_pending exceeded)")
        slot = self._free.popleft()
        self._busy[job.span] = slot
        self._jobs.put((job, self.rings[slot]))

    def poll(self) -> list[CopyResult]:
        """Results finished so far, without waiting."""
        out = []
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self._retire(self._done.get_nowait()))
        return out

    def wait(self) -> CopyResult:
        """Block until the next span finishes."""
        return self._retire(self._done.get())

    def drain(self) -> list[CopyResult]:
        """Block until nothing is in flight; every result."""
        return [self.wait() for _ in range(self.in_flight)]

    def warm_up(self, jobs: list[CopyJob]) -> None:
        """Before t = 0: run throwaway jobs on the worker (one per ring slot: every staging
        buffer first-touched, copy kernels loaded), then zero the decoder pool on the import
        stream (every page touched, nothing of the warm-up left). Nothing is reported."""
        if len(jobs) > len(self._free):
            raise RuntimeError("copier: warm-up needs at most one job per free staging slot")
        for job in jobs:
            self.submit(job)
        errors = [r.error for r in self.drain() if r.error is not None]
        with self.backend.decoder_stream():
            self.pool.kv.zero_()
        self.backend.sync_decoder()
        if errors:
            raise RuntimeError(f"copier: warm-up copy failed: {errors[0]}")

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _retire(self, result: CopyResult) -> CopyResult:
        self._free.append(self._busy.pop(result.job.span))
        return result

    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            self._done.put(self._run(*item))

    def _run(self, job: CopyJob, ring: Ring) -> CopyResult:
        stages: list[StageTime] = []
        try:
            self._copy(job, ring, stages)
            return CopyResult(job, None, tuple(stages))
        except Exception as e:  # a failed copy is reported, never raised on the worker thread
            return CopyResult(job, f"{type(e).__name__}: {e}", tuple(stages))

    def _copy(self, job: CopyJob, ring: Ring, stages: list[StageTime]) -> None:
        nl, nt = length(job.layers), length(job.tokens)
        shape = (nl, 2, nt, *self.source_kv.shape[3:])  # [nl, 2, nt, KVH, D]
        elems = nl * 2 * nt * self.source_kv.shape[3] * self.source_kv.shape[4]
        views = [buf[:elems].view(shape) for buf in (ring.gather, ring.host, ring.landing)]
        self.backend.wait_ready(job.ready)
        self._stage(stages, "gather", "producer", lambda: self._gather(job, views[0]))
        self._stage(stages, "d2h", "link", lambda: self._d2h(views[0], views[1]))
        self._stage(stages, "h2d", "link", lambda: self._h2d(job, views[1], views[2]))

    def _stage(self, stages: list[StageTime], name: str, resource: str, work) -> None:
        start = self.clock()
        work()
        stages.append(StageTime(name, start, self.clock(), resource))

    def _gather(self, job: CopyJob, out: torch.Tensor) -> None:
        with self.backend.producer_stream():
            gather(self.source_kv, job.src_slots, job.layers, job.tokens, out)
        self.backend.sync_producer()

    def _d2h(self, src: torch.Tensor, host: torch.Tensor) -> None:
        with self.backend.producer_stream():
            host.copy_(src, non_blocking=True)
        self.backend.sync_producer()

    def _h2d(self, job: CopyJob, host: torch.Tensor, landing: torch.Tensor) -> None:
        start = time.perf_counter()
        with self.backend.decoder_stream():
            if landing.data_ptr() != host.data_ptr():
                landing.copy_(host, non_blocking=True)
            if job.fail:
                self._fail_halfway(job, landing)
            self.pool.write_span(job.slab, job.layers, job.tokens, landing)
        self.backend.sync_decoder()
        self._pace(start, landing.numel() * landing.element_size())

    def _fail_halfway(self, job: CopyJob, landing: torch.Tensor) -> None:
        """Fault injection: write the first half of the span, then fail."""
        half = length(job.tokens) // 2
        tokens = (job.tokens[0], job.tokens[0] + half)
        self.pool.write_span(job.slab, job.layers, tokens, landing[:, :, :half])
        self.backend.sync_decoder()
        raise CopyFault(f"injected fault on span {job.span}")

    def _pace(self, start: float, nbytes: int) -> None:
        """Hold the stage until `nbytes` could have crossed a `link_gbps` link."""
        if self.config.link_gbps is None:
            return
        remaining = start + nbytes / (self.config.link_gbps * 1e9) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


def _best_copy_s(backend: CpuBackend, dst: torch.Tensor, src: torch.Tensor, repeats: int):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with backend.producer_stream():
            dst.copy_(src, non_blocking=True)
        backend.sync_producer()
        best = min(best, time.perf_counter() - start)
    return best


def measure_copy_bandwidth(device, nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """Best-of-`repeats` GB/s of device->host and host->device copies through the staging
    kind of host memory the copier uses (pinned on CUDA), on a copy stream."""
    device = torch.device(device)
    backend = make_backend(device, device)
    host = backend.host_buffer(nbytes, torch.uint8)  # [nbytes]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)  # [nbytes]
    return {
        "d2h_gbps": nbytes / _best_copy_s(backend, host, dev, repeats) / 1e9,
        "h2d_gbps": nbytes / _best_copy_s(backend, dev, host, repeats) / 1e9,
        "bytes": nbytes,
        "pinned": device.type == "cuda" and bool(host.is_pinned()),
    }
