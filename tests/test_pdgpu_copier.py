"""pdgpu.copier, source cache and decoder pool: the bytes a span moves and the worker's rules."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import pytest
import torch

from pdgpu.copier import Copier, CopierConfig, CopyJob, measure_copy_bandwidth
from pdgpu.decoder_pool import DecoderPool
from pdgpu.source_cache import SourceCache, gather, token_slots
from pdgpu.streams import Backend, CudaLane, EventClock, HostMark, record
from pdref.geometry import Geometry

WAIT_S = 60  # every wait on the copier is bounded: a lost result fails, it does not hang

GEO = Geometry(layers=3, kv_heads=2, head_dim=4, dtype_bytes=4, page_tokens=4)


def _filled_source(prompt: int = 20):
    """A source cache whose every element is distinct, and one request's view of it."""
    source = SourceCache(GEO, 16, "cpu", torch.float32)
    source.open(6)  # someone else's pages first: the request's pages start at 2
    request = source.open(prompt)
    source.kv.copy_(torch.arange(source.kv.numel(), dtype=torch.float32).view_as(source.kv))
    return source, request


def test_token_slots_follow_the_page_table():
    """Token t lives at pages[t // page_tokens] * page_tokens + t % page_tokens."""
    slots = token_slots((5, 2, 9), 4, 10, "cpu")
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 36, 37]


def test_gather_reads_the_region_out_of_scattered_pages():
    """gather() copies exactly layers x tokens of the request into the buffer."""
    source, request = _filled_source()
    out = torch.empty(2, 2, 7, 2, 4)
    gather(source.kv, request.slots, (1, 3), (5, 12), out)
    want = torch.stack([source.kv[layer][:, request.slots[5:12]] for layer in (1, 2)])
    assert torch.equal(out, want)


def test_write_span_lands_in_the_slab_pages_only():
    """write_span() writes the slab's slots for those tokens and touches nothing else."""
    pool = DecoderPool(GEO, 8, "cpu", torch.float32)
    slab = pool.slab((6, 1, 3), prefix=8, prompt=20)
    kv = torch.randn(3, 2, 5, 2, 4)
    pool.write_span(slab, (0, 3), (10, 15), kv)
    assert torch.equal(pool.read_slab(slab)[:, :, 2:7], kv)
    assert int((pool.kv != 0).sum()) == int((kv != 0).sum())


def _clock():
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


def _copier(slots=2, link=None, span_elems=3 * 2 * 8 * 2 * 4, on_done=None, backend=None):
    source, request = _filled_source()
    pool = DecoderPool(GEO, 8, "cpu", torch.float32)
    clock = backend.clock if backend is not None else _clock()
    copier = Copier(CopierConfig(slots, span_elems, link), source.kv, pool, clock, on_done,
                    backend)
    return copier, source, request, pool


def _job(copier, request, slab, span, tokens, fail=False, ready=None):
    return CopyJob(span, "r", (0, 3), tokens, request.slots, slab,
                   ready or copier.mark_ready(), fail)


def test_copier_moves_spans_into_the_decoder_in_order():
    """Spans submitted to the lanes land byte-exact in the slab, results in order."""
    copier, source, request, pool = _copier()
    slab = pool.slab((4, 0, 7, 2, 5), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8)))
        copier.submit(_job(copier, request, slab, 1, (8, 16)))
        results = [copier.wait(WAIT_S), copier.wait(WAIT_S)]
    finally:
        copier.close()
    assert [r.job.span for r in results] == [0, 1] and all(r.error is None for r in results)
    assert [s.name for s in results[0].stages] == ["gather", "d2h", "h2d"]
    assert torch.equal(pool.read_slab(slab)[:, :, :16], source.kv[:, :, request.slots[:16]])


def test_copier_refuses_more_than_its_ring_until_a_span_completed():
    """A third span with two staging slots in use is refused, not queued; once a span
    completed its slot takes the next one."""
    copier, _, request, pool = _copier(slots=2, link=0.0001)
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 4)))
        copier.submit(_job(copier, request, slab, 1, (4, 8)))
        with pytest.raises(RuntimeError, match="max_pending"):
            copier.submit(_job(copier, request, slab, 2, (8, 12)))
        assert copier.wait(WAIT_S).job.span == 0
        copier.submit(_job(copier, request, slab, 2, (8, 12)))
        assert copier.drain(timeout=WAIT_S), f"{copier.in_flight} spans never reported"
        assert copier.in_flight == 0 and copier.free_slots == 2
    finally:
        copier.close()


def test_slot_is_free_before_on_done_and_in_flight_counts_it_until_after():
    """The watcher returns a span's slot before reporting it (a land may be followed by an
    issue at once) and counts it in flight until the report is done (drain sees the land)."""
    seen = []
    copier, _, request, pool = _copier(
        slots=1, on_done=lambda r: seen.append((copier.free_slots, copier.in_flight)))
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8)))
        assert copier.drain(timeout=WAIT_S), f"{copier.in_flight} spans never reported"
    finally:
        copier.close()
    assert seen == [(1, 1)] and copier.in_flight == 0


def test_injected_fault_is_reported_after_its_writer_stopped():
    """A failing copy comes back as a result with the error, after writing half the span;
    the lanes keep working for the next span."""
    copier, source, request, pool = _copier()
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8), fail=True))
        copier.submit(_job(copier, request, slab, 1, (8, 16)))
        failed, ok = copier.wait(WAIT_S), copier.wait(WAIT_S)
    finally:
        copier.close()
    assert "injected fault on span 0" in failed.error and ok.error is None
    landed = pool.read_slab(slab)
    assert torch.equal(landed[:, :, :4], source.kv[:, :, request.slots[:4]])
    assert not landed[:, :, 4:8].any()
    assert failed.done_t >= max(s.end for s in failed.stages)


def test_link_pacing_holds_each_direction():
    """At link_gbps both the d2h and the h2d stage last at least bytes / bandwidth."""
    copier, _, request, pool = _copier(link=0.001)
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8)))
        result = copier.wait(WAIT_S)
    finally:
        copier.close()
    floor = 3 * 2 * 8 * 2 * 4 * 4 / 1e6 * 0.95
    for name in ("d2h", "h2d"):
        stage = next(s for s in result.stages if s.name == name)
        assert stage.end - stage.start >= floor, name


class Traced:
    """Wraps a copier's lanes: each stage's start and end go into one ordered log as
    (lane, span, "start" | "end"), and a stage may be held until an event is set (at most
    30 s, then its span fails), so a test forces an interleaving and reads the order."""

    def __init__(self, copier: Copier) -> None:
        self.log, self.lock = [], threading.Lock()
        self.holds: dict[tuple, threading.Event] = {}
        self.reached: dict[tuple, threading.Event] = {}
        for lane in copier.backend.lanes.values():
            self._wrap(lane)

    def event(self, lane: str, span: int, what: str) -> threading.Event:
        """Set once `lane` started or ended (`what`) span `span`'s stage."""
        return self.reached.setdefault((lane, span, what), threading.Event())

    def before(self, first: tuple, second: tuple) -> bool:
        return self.log.index(first) < self.log.index(second)

    def _wrap(self, lane) -> None:
        run, spans = lane.run, itertools.count()

        def traced(after, work, nbytes):
            key = (lane.name, next(spans))  # a lane runs its spans in issue order
            return run(after, lambda: self._stage(key, work), nbytes)
        lane.run = traced

    def _stage(self, key: tuple, work) -> None:
        self._note(*key, "start")
        hold = self.holds.get(key)
        if hold is not None and not hold.wait(30):
            raise RuntimeError(f"{key} held: what it waited for never happened")
        work()
        self._note(*key, "end")

    def _note(self, lane: str, span: int, what: str) -> None:
        with self.lock:
            self.log.append((lane, span, what))
        self.event(lane, span, what).set()


def test_spans_pipeline_d2h_of_the_next_overlaps_h2d_of_the_previous():
    """Span 1's d2h runs while span 0's h2d does: span 1's d2h is held until span 0's h2d
    started, and that h2d until span 1's d2h ended (a copier running one span at a time
    would never get there: a span fails). Each direction carries one span at a time, and a
    span's stages run in order."""
    copier, _, request, pool = _copier(slots=2)
    traced = Traced(copier)
    traced.holds["d2h", 1] = traced.event("h2d", 0, "start")
    traced.holds["h2d", 0] = traced.event("d2h", 1, "end")
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8)))
        copier.submit(_job(copier, request, slab, 1, (8, 16)))
        results = [copier.wait(WAIT_S), copier.wait(WAIT_S)]
    finally:
        copier.close()
    assert [r.error for r in results] == [None, None]
    assert traced.before(("h2d", 0, "start"), ("d2h", 1, "end"))
    assert traced.before(("d2h", 1, "end"), ("h2d", 0, "end"))
    assert traced.before(("d2h", 0, "end"), ("d2h", 1, "start"))
    assert traced.before(("h2d", 0, "end"), ("h2d", 1, "start"))
    assert traced.before(("d2h", 0, "end"), ("h2d", 0, "start"))


def test_gather_waits_for_the_readiness_mark():
    """A span whose readiness mark is not done yet is not gathered until it is."""
    copier, _, request, pool = _copier()
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    ready = HostMark(copier.clock)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8), ready=ready))
        time.sleep(0.05)
        assert copier.in_flight == 1 and not pool.kv.any()
        ready.set()
        result = copier.wait(WAIT_S)
    finally:
        copier.close()
    assert result.error is None and result.stages[0].start >= ready.time()


def test_staging_is_allocated_once_for_the_ring():
    """The ring holds `slots` buffers of the largest span on each side, allocated up front."""
    copier, *_ = _copier(slots=3, span_elems=100)
    copier.close()
    assert copier.host_staging_bytes == 3 * 100 * 4
    assert copier.source_side_bytes == 2 * 3 * 100 * 4  # gather + host on a CPU producer


def test_copy_bandwidth_probe_reports_both_directions():
    """The bandwidth probe returns positive GB/s for d2h and h2d."""
    bw = measure_copy_bandwidth("cpu", 1 << 20, repeats=2)
    assert bw["d2h_gbps"] > 0 and bw["h2d_gbps"] > 0 and bw["pinned"] is False


# -- the CUDA path's structure on a fake device: streams log what is enqueued, events
#    complete only once the test starts the fake device ---------------------------------------


class FakeDevice:
    """Events recorded on fake streams complete once the test starts the device (`run`): those
    recorded before at once, every later one as it is recorded, as a real device's streams
    keep running. (A `run` that completed only what was recorded by then hung the watcher
    forever on an event a late lane thread recorded after it; see
    test_an_event_recorded_after_the_device_started_still_completes.)"""

    def __init__(self) -> None:
        self.recorded, self.syncs, self.running = [], [], False
        self.changed = threading.Condition()

    def run(self) -> None:
        with self.changed:
            self.running = True
            for event in self.recorded:
                event.complete()

    def on_record(self, event) -> None:
        with self.changed:
            self.recorded.append(event)
            if self.running:
                event.complete()
            self.changed.notify_all()

    def on_sync(self) -> None:
        with self.changed:
            self.syncs.append(threading.current_thread().name)
            self.changed.notify_all()

    def wait_until(self, predicate) -> None:
        """Block (at most 30 s) until `predicate()` holds: the lanes or the watcher got there."""
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=30), (self.recorded, self.syncs)


class FakeEvent:
    device: FakeDevice

    def __init__(self, enable_timing=False) -> None:
        self.done, self.t = threading.Event(), None

    def record(self, stream) -> None:
        stream.log.append(("record", self, threading.current_thread().name))
        self.device.on_record(self)

    def complete(self) -> None:
        if not self.done.is_set():
            self.t = time.perf_counter()
            self.done.set()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.device.on_sync()
        if not self.done.wait(WAIT_S):
            raise RuntimeError("a fake event never completed")

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name, self.log = name, []

    def wait_event(self, event) -> None:
        self.log.append(("wait", event, threading.current_thread().name))

    def synchronize(self) -> None:
        raise AssertionError("the copy path never synchronizes a stream")


class FakeCudaBackend(Backend):
    """Backend with CUDA lanes on fake streams (gather and d2h share the producer's copy
    stream, h2d has the decoder's) and readiness marks recorded on a fake compute stream."""

    def __init__(self, clock, device: FakeDevice, link_gbps=None) -> None:
        self.producer = self.decoder = torch.device("cpu")
        self.clock, self.cuda = clock, False
        anchor = FakeEvent()
        anchor.complete()
        self.events = EventClock.__new__(EventClock)
        self.events.clock, self.events.anchor = clock, anchor
        self.events.anchor_abs = anchor.t
        self.compute = FakeStream("compute")
        copy, decode = FakeStream("copy"), FakeStream("decode")
        self.lanes = {"gather": CudaLane("gather", clock, None, copy, self.events),
                      "d2h": CudaLane("d2h", clock, link_gbps, copy, self.events),
                      "h2d": CudaLane("h2d", clock, link_gbps, decode, self.events)}

    def mark_ready(self):
        return record(self.compute, self.events)


@pytest.fixture
def fake_cuda(monkeypatch):
    device = FakeDevice()
    FakeEvent.device = device
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return device


# Events two spans record: 2 readiness marks, then a start and an end per stage per span.
ALL_RECORDED = 2 + 2 * 3 * 2


def _blocked_before_the_device_ran(device: FakeDevice) -> None:
    """Wait until the lanes enqueued both spans and the watcher waits on an event: from
    here on nothing can be reported before the device runs."""
    device.wait_until(lambda: len(device.recorded) == ALL_RECORDED and device.syncs)


def test_cuda_lanes_chain_events_and_report_only_after_the_device_ran(fake_cuda):
    """On the CUDA path the lanes only enqueue: each stage waits the previous stage's event
    on its stream (gather waits the readiness event), nothing is reported and no slot comes
    back before the h2d event completed, and only the watcher ever waits for an event."""
    reports = []
    backend = FakeCudaBackend(_clock(), fake_cuda)
    copier, _, request, pool = _copier(slots=2, on_done=reports.append, backend=backend)
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        readies = [copier.mark_ready(), copier.mark_ready()]
        for span, tokens in ((0, (0, 8)), (1, (8, 16))):
            copier.submit(_job(copier, request, slab, span, tokens, ready=readies[span]))
        _blocked_before_the_device_ran(fake_cuda)
        assert reports == [] and copier.free_slots == 0 and copier.in_flight == 2
        fake_cuda.run()
        assert copier.drain(timeout=30)
    finally:
        copier.close()
    log = backend.lanes["gather"].stream.log + backend.lanes["h2d"].stream.log
    waits = {lane: [e for op, e, t in log if op == "wait" and t == f"pdgpu-{lane}"]
             for lane in ("gather", "d2h", "h2d")}
    ends = {lane: [e for op, e, t in log if op == "record" and t == f"pdgpu-{lane}"][1::2]
            for lane in ("gather", "d2h", "h2d")}  # each stage records a start and an end
    assert waits["gather"] == [r.event for r in readies]
    assert waits["d2h"] == ends["gather"] and waits["h2d"] == ends["d2h"]
    assert all(t == "pdgpu-h2d" for *_, t in backend.lanes["h2d"].stream.log)
    assert [r.job.span for r in reports] == [0, 1] and all(r.error is None for r in reports)
    assert all(r.done_t >= max(s.end for s in r.stages) for r in reports)
    assert set(fake_cuda.syncs) == {"pdgpu-watcher"}
    assert copier.free_slots == 2


def test_cuda_link_pacing_holds_each_direction_and_orders_the_next_on_the_host(fake_cuda):
    """With link pacing on the CUDA path, d2h and h2d each last at least bytes / rate (the
    lane waits its event, then holds), and h2d starts only after d2h's held end."""
    backend = FakeCudaBackend(_clock(), fake_cuda, link_gbps=0.001)
    copier, _, request, pool = _copier(backend=backend)
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    fake_cuda.run()
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8)))
        result = copier.wait(WAIT_S)
    finally:
        copier.close()
    stage = {s.name: s for s in result.stages}
    floor = 3 * 2 * 8 * 2 * 4 * 4 / 1e6 * 0.95
    assert result.error is None
    assert stage["d2h"].end - stage["d2h"].start >= floor
    assert stage["h2d"].end - stage["h2d"].start >= floor
    assert stage["h2d"].start >= stage["d2h"].end


def test_cuda_failed_span_is_reported_after_the_device_ran_and_the_next_span_still_runs(
        fake_cuda):
    """On the CUDA path a span whose h2d work raises is not reported (nor its slot given
    back) before the device ran what was enqueued before its end event; it comes back with
    the error, after its writer stopped, and the next span on the same lanes lands."""
    reports = []
    backend = FakeCudaBackend(_clock(), fake_cuda)
    copier, source, request, pool = _copier(slots=2, on_done=reports.append, backend=backend)
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8), fail=True))
        copier.submit(_job(copier, request, slab, 1, (8, 16)))
        _blocked_before_the_device_ran(fake_cuda)
        assert reports == [] and copier.free_slots == 0
        fake_cuda.run()
        assert copier.drain(timeout=30)
    finally:
        copier.close()
    failed, ok = reports
    assert "injected fault on span 0" in failed.error and ok.error is None
    assert [s.name for s in failed.stages] == ["gather", "d2h", "h2d"]
    assert failed.done_t >= max(s.end for s in failed.stages)
    assert torch.equal(pool.read_slab(slab)[:, :, 8:16], source.kv[:, :, request.slots[8:16]])
    assert copier.free_slots == 2


def test_an_event_recorded_after_the_device_started_still_completes(fake_cuda):
    """The interleaving that hung the failed-span test (issue 27), forced: the h2d lane is
    late and enqueues its stages only after the device started. Every span still lands
    (a device that completed only what was recorded when it started left drain waiting)."""
    reports = []
    backend = FakeCudaBackend(_clock(), fake_cuda)
    copier, source, request, pool = _copier(slots=2, on_done=reports.append, backend=backend)
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    late = threading.Event()
    backend.lanes["h2d"].put(late.wait)  # the h2d lane's thread, not yet scheduled
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8), fail=True))
        copier.submit(_job(copier, request, slab, 1, (8, 16)))
        fake_cuda.wait_until(lambda: len(fake_cuda.recorded) == ALL_RECORDED - 4)  # no h2d
        fake_cuda.run()
        late.set()
        assert copier.drain(timeout=30), f"{copier.in_flight} spans never reported"
    finally:
        late.set()
        fake_cuda.run()  # whatever is still pending completes, so close() can join
        copier.close()
    assert [r.job.span for r in reports] == [0, 1] and reports[1].error is None
    assert torch.equal(pool.read_slab(slab)[:, :, 8:16], source.kv[:, :, request.slots[8:16]])
