"""The copy path of one producer. With streams.py (lanes, marks, backends) and
copy_bandwidth.py (the raw link measured), the only modules of pdgpu that know streams,
events and pinned memory. Its jobs and results are copy_job.py's.

Every span runs through three stages, each on its own lane (streams.py), in issue order:
  gather  index the span out of the source pages into its staging slot's gather buffer
          (after the span's readiness mark: its compute is done)
  d2h     gather buffer -> the slot's host staging buffer (pinned on CUDA)
  h2d     host staging -> the decoder slab (through a landing buffer on a CUDA decoder)
On CUDA gather and d2h are enqueued on the producer's copy stream, h2d on the decoder's copy
stream, each behind the previous stage's CUDA event: the host never synchronizes, and span
k+1's d2h overlaps span k's h2d. On CPU each lane is a thread doing its stage, so stages of
different spans overlap the same way; `link_gbps` paces d2h and h2d (each direction of the
link) to bytes / rate.
A watcher thread takes spans in issue order, waits until every stage of one completed (its
writer has stopped), puts its staging slot back (only then may it be reused) and hands a
`CopyResult` to `on_done` at once: the engine stamps `land` (or `fail`) there.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import attrs
import torch

from pdgpu.copy_bandwidth import measure_copy_bandwidth
from pdgpu.copy_job import CopierConfig, CopyFault, CopyJob, CopyResult, StageTime
from pdgpu.decoder_pool import DecoderPool
from pdgpu.handoff import KVPiece, StatePiece, staged
from pdgpu.source_cache import gather
from pdgpu.state_pool import StatePool, state_views
from pdgpu.streams import STAGES, Backend, Mark, Ring
from pdref.intervals import length


@attrs.frozen
class _InFlight:
    job: CopyJob
    slot: int
    stages: tuple[Future, ...]  # per stage: (start, end) marks once its lane ran it


class Copier:
    """The copy lanes and the watcher of one producer; the engine submits spans, results
    come to `on_done` on the watcher thread as they complete."""

    def __init__(self, config: CopierConfig, source_kv: torch.Tensor, pool: DecoderPool,
                 clock: Callable[[], float], on_done: Callable[[CopyResult], None] | None = None,
                 backend: Backend | None = None, source_states: StatePool | None = None):
        self.config, self.source_kv, self.pool, self.clock = config, source_kv, pool, clock
        self.source_states = source_states  # the producer's state slots (a state span's source)
        kv = source_kv
        self.cell_bytes = 2 * kv.shape[3] * kv.shape[4] * kv.element_size()  # a layer's token
        self.backend = backend or Backend(source_kv.device, pool.device, clock, config.link_gbps)
        self.rings = [self.backend.make_ring(config.span_elems, source_kv.dtype)
                      for _ in range(config.slots)]
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self.on_done = on_done or self._results.put
        self._cond = threading.Condition()
        self._free = deque(range(config.slots))
        self._in_flight = 0
        self.completions = 0  # spans reported so far (see wait_progress)
        self.callback_error: BaseException | None = None
        self._watch: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher = threading.Thread(target=self._watch_loop, name="pdgpu-watcher",
                                         daemon=True)
        self._watcher.start()

    # -- sizes ------------------------------------------------------------------------------

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
        """Spans submitted and not yet reported to `on_done`."""
        return self._in_flight

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # -- the engine's side ------------------------------------------------------------------

    def mark_ready(self) -> Mark:
        """Readiness of everything computed so far (record after each compute step)."""
        return self.backend.mark_ready()

    def submit(self, job: CopyJob) -> None:
        """Queue the span's three stages on their lanes; returns at once."""
        with self._cond:
            if not self._free:
                raise RuntimeError("copier: every staging buffer is in use (max_pending exceeded)")
            slot = self._free.popleft()
            self._in_flight += 1
        views = self._views(job, self.rings[slot])
        stages = tuple(Future() for _ in STAGES)
        works = (lambda: self._gather(job, views[0]),
                 lambda: views[1].copy_(views[0], non_blocking=True),
                 lambda: self._land(job, views[1], views[2]))
        nbytes = views[0].numel() * views[0].element_size()
        afters = (lambda: job.ready, *(_end_of(f) for f in stages[:-1]))
        for i, (name, _) in enumerate(STAGES):
            self.backend.lanes[name].put(self._task(name, afters[i], works[i], nbytes, stages[i]))
        self._watch.put(_InFlight(job, slot, stages))

    def wait_progress(self, seen: int, timeout: float | None = None) -> None:
        """Block until more than `seen` spans were reported (read `completions` before
        checking whatever the caller waits for, then pass it here)."""
        with self._cond:
            self._cond.wait_for(lambda: self.completions > seen or not self._in_flight, timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every span submitted was reported (True), or `timeout` s passed
        (False: spans are still in flight)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._in_flight, timeout)

    def wait(self, timeout: float | None = None) -> CopyResult:
        """The next result, when no `on_done` was given (tests, benchmarks); queue.Empty when
        none comes within `timeout` seconds (None: no limit)."""
        return self._results.get(timeout=timeout)

    def warm_up(self, jobs: list[CopyJob]) -> None:
        """Before t = 0: run throwaway jobs (one per ring slot: every staging buffer
        first-touched, copy kernels loaded), then zero the decoder pool on its lane's
        device. Nothing is reported to `on_done`."""
        if len(jobs) > len(self._free):
            raise RuntimeError("copier: warm-up needs at most one job per free staging slot")
        on_done, self.on_done = self.on_done, self._results.put
        try:
            for job in jobs:
                self.submit(job)
            self.drain()
            errors = [e for e in (self._results.get().error for _ in jobs) if e is not None]
        finally:
            self.on_done = on_done
        self.zero_pool()
        if errors:
            raise RuntimeError(f"copier: warm-up copy failed: {errors[0]}")

    def decoder_side(self):
        """A context for decoder-pool work outside the spans (slab tables, scrubbing): on the
        h2d lane's stream, so the span writes enqueued there later are ordered after it."""
        return self.backend.lanes["h2d"].context()

    def zero_pool(self) -> None:
        """Zero the decoder pool where the h2d lane writes it, and wait for it."""
        lane = self.backend.lanes["h2d"]
        with lane.context():
            self.pool.kv.zero_()
        lane.sync()

    def close(self) -> None:
        self._watch.put(None)
        self._watcher.join()
        self.backend.close()

    # -- the lanes' side --------------------------------------------------------------------

    def _views(self, job: CopyJob, ring: Ring) -> list[torch.Tensor]:
        """The span's part [n] of the slot's gather, host and landing buffers."""
        elems = -(-staged(job.pieces, self.cell_bytes)[1] // self.source_kv.element_size())
        return [buf[:elems] for buf in (ring.gather, ring.host, ring.landing)]

    def _placed(self, job: CopyJob, flat: torch.Tensor):
        """(piece, its tensors in `flat`) for each piece: a K/V block [nl, 2, nt, KVH, D];
        a state's conv [nl, C, K-1] and recurrent [nl, Hv, Dk, Dv] views."""
        raw = flat.view(torch.uint8)
        offsets = staged(job.pieces, self.cell_bytes)[0]
        for piece, at in zip(job.pieces, offsets, strict=True):
            window = raw[at:at + piece.size(self.cell_bytes)]
            if isinstance(piece, KVPiece):
                shape = (length(piece.layers), 2, length(piece.tokens), *self.source_kv.shape[3:])
                yield piece, (window.view(self.source_kv.dtype).view(shape),)
            else:
                yield piece, state_views(self.source_states.shape, length(piece.layers), window)

    def _gather(self, job: CopyJob, flat: torch.Tensor) -> None:
        """Every piece out of the source (pages, state slot) into the gather buffer."""
        for piece, views in self._placed(job, flat):
            if isinstance(piece, KVPiece):
                gather(self.source_kv, job.src_slots, piece.layers, piece.tokens, views[0])
            else:
                self.source_states.copy_out(piece.layers, piece.source_slot, *views)

    def _task(self, name: str, after, work, nbytes: int, out: Future):
        lane = self.backend.lanes[name]

        def task() -> None:
            try:
                out.set_result(lane.run(after(), work, nbytes))
            except BaseException as e:  # a lane must never die: report through the future
                out.set_exception(e)
        return task

    def _land(self, job: CopyJob, host: torch.Tensor, landing: torch.Tensor) -> None:
        """host staging -> decoder slab and state slot (on the decoder lane's stream)."""
        if landing.data_ptr() != host.data_ptr():
            landing.copy_(host, non_blocking=True)
        for piece, views in self._placed(job, landing):
            if isinstance(piece, StatePiece):
                self.pool.states.copy_in(piece.layers, piece.slot, *views)
            elif job.fail:  # the first half of the first block, then the failure
                half = length(piece.tokens) // 2
                tokens = (piece.tokens[0], piece.tokens[0] + half)
                self.pool.write_span(job.slab, piece.layers, tokens, views[0][:, :, :half])
                break
            else:
                self.pool.write_span(job.slab, piece.layers, piece.tokens, views[0])
        if job.fail:
            raise CopyFault(f"injected fault on span {job.span}")

    def _watch_loop(self) -> None:
        while (item := self._watch.get()) is not None:
            result = self._complete(item)
            with self._cond:
                self._free.append(item.slot)  # every stage is done: the slot may be reused
            try:
                self.on_done(result)
            except BaseException as e:  # e.g. a live violation: the engine re-raises it
                self.callback_error = self.callback_error or e
            with self._cond:
                self._in_flight -= 1
                self.completions += 1
                self._cond.notify_all()

    def _complete(self, item: _InFlight) -> CopyResult:
        """Wait until every stage of the span completed; its result."""
        stages, error = [], None
        for (name, resource), future in zip(STAGES, item.stages, strict=True):
            try:
                start, end = future.result()
            except BaseException as e:
                error = error or f"{type(e).__name__}: {e}"
                continue
            end.wait()
            error = error or end.error
            if start is not None:
                stages.append(StageTime(name, start.time(), end.time(), resource))
        return CopyResult(item.job, error, tuple(stages), self.clock())


def _end_of(stage: Future):
    """The end mark of a stage once its lane ran it (waits for the lane, not the device)."""
    return lambda: stage.result()[1]


__all__ = ["CopierConfig", "CopyFault", "CopyJob", "CopyResult", "Copier", "StageTime",
           "measure_copy_bandwidth"]
