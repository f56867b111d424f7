"""pdgpu.engine: bit-exact parity of chunk/layer with whole, failures, back-to-back, live checks."""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager

import attrs
import pytest
import torch
from timing_helpers import no_gc_pauses

from pdgpu.decoder_pool import DecoderPool
from pdgpu.engine import Engine, EngineError
from pdgpu.engine_ledger import EngineLedger
from pdgpu.generate import prefill_chunks
from pdgpu.handoff import kv_groups
from pdgpu.model import build_model
from pdgpu.payload import fill_payload, payload_matches, payload_values
from pdgpu.prefill import Prefill
from pdgpu.recorder import Recorder
from pdgpu.source_cache import SourceCache
from pdgpu.step_loop import Loop, Pending
from pdgpu.streams import Backend, HostMark
from pdgpu.workload import DEBUG_BREAKS, EngineConfig, Request, WorkloadError, setup_check
from pdref import events as ev
from pdref.check import check_lines
from pdref.models import load_model
from pdref.plan import Region, plan_steps
from pdref.trace import dumps
from pdref.violations import Violation

TINY = attrs.evolve(load_model("tiny"), dtype="float32")
LLAMA = attrs.evolve(TINY, name="tiny-llama", arch="llama", tie_embeddings=False)
MODELS = {"qwen3": build_model(TINY, seed=0), "llama": build_model(LLAMA, seed=1)}


def _tokens(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(torch.randint(0, TINY.vocab, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


def _run(mode, requests, model="qwen3", **kw):
    config = EngineConfig(mode, keep_kv=True, **kw)
    return Engine(MODELS[model], config).run(requests)


def _check(result, open_trace=False):
    """pdref's checker on the trace the run would write."""
    lines = [dumps(ev.header_to_json(result.header)).encode()]
    lines += [dumps(ev.event_to_json(e)).encode() for e in result.events]
    return check_lines(lines, open_trace=open_trace)


def _reference_kv(model, tokens, prefix, chunk):
    """K/V [L, 2, suffix, KVH, D] of a plain prefill in the engine's chunks (the prefix's,
    then the suffix's): what the decoder must hold."""
    cache = SourceCache(model.spec.geometry(16), 64, "cpu", torch.float32)
    request = cache.open(len(tokens))
    ids = torch.tensor(tokens)
    for a, b in prefill_chunks(len(tokens), prefix, chunk):
        model.prefill_chunk(ids[a:b], a, request)
    return cache.kv[:, :, request.slots[prefix:]]


CASES = [
    # (model, prompt, prefix, chunk, max_pending)
    ("qwen3", 100, 0, 32, 2),
    ("qwen3", 100, 32, 24, 2),  # prefix reuse, chunks not page aligned
    ("qwen3", 64, 64, 16, 2),  # empty suffix
    ("qwen3", 50, 16, 200, 2),  # chunk larger than the suffix
    ("qwen3", 97, 16, 8, 1),  # many spans, one in flight
    ("llama", 77, 16, 20, 3),
]


@pytest.mark.parametrize("model,prompt,prefix,chunk,max_pending", CASES)
def test_chunk_and_layer_kv_are_bit_identical_to_whole(model, prompt, prefix, chunk, max_pending):
    """Decoder KV and first token after chunk/layer handoff equal whole's; traces check ok."""
    request = [Request("r", _tokens(prompt), prefix)]
    runs = {m: _run(m, request, model, chunk=chunk, max_pending=max_pending)
            for m in ("whole", "chunk", "layer")}
    base = runs["whole"].outcomes[0]
    for mode, result in runs.items():
        assert _check(result).ok, (mode, _check(result))
        assert torch.equal(result.outcomes[0].kv, base.kv), mode
        assert result.outcomes[0].first_token == base.first_token, mode
    assert base.kv.shape[2] == prompt - prefix


def test_whole_handoff_carries_the_models_kv():
    """What lands in the decoder is the model's K/V of the suffix (not just equal garbage)."""
    tokens = _tokens(90, seed=3)
    result = _run("whole", [Request("r", tokens, 32)], chunk=90)
    assert torch.equal(result.outcomes[0].kv, _reference_kv(MODELS["qwen3"], tokens, 32, 90))


def test_failed_span_aborts_returns_pages_and_retry_is_exact():
    """--fail-span: fail, abort, pages back, and the retried KV equals a clean run's."""
    request = [Request("r", _tokens(100), 16)]
    clean = _run("chunk", request, chunk=16)
    failed = _run("chunk", request, chunk=16, fail_span=2)
    kinds = [e.kind for e in failed.events]
    assert kinds.count("fail") == 1 and kinds.count("abort") == 1 and kinds.count("reserve") == 2
    assert failed.outcomes[0].attempts == 2
    assert torch.equal(failed.outcomes[0].kv, clean.outcomes[0].kv)
    assert _check(failed).ok
    assert failed.metrics["failed_spans"] == 1


def test_retries_are_bounded():
    """With no retry left, a failed copy ends the run with an EngineError, not a hang."""
    with pytest.raises(EngineError, match="failed on all 1 attempts"):
        _run("whole", [Request("r", _tokens(40), 0)], chunk=16, fail_span=0, retries=0)


def test_back_to_back_requests_reuse_source_pages_at_once():
    """A second request overwrites the first's source pages and still hands off exactly."""
    a, b = _tokens(80, seed=1), _tokens(80, seed=2)
    both = _run("chunk", [Request("a", a, 0), Request("b", b, 16)], chunk=16)
    alone = _run("chunk", [Request("b", b, 16)], chunk=16)
    assert torch.equal(both.outcomes[1].kv, alone.outcomes[0].kv)
    assert not torch.equal(both.outcomes[0].kv[:, :, 16:], both.outcomes[1].kv)
    reuse = [e for e in both.events if e.kind == "reuse"]
    assert [e.req for e in reuse] == ["a", "b"]
    assert _check(both).ok


def test_slow_link_blocks_the_producer_and_bounds_staging():
    """With a paced link, the producer blocks on max_pending and staging stays at 2 spans."""
    result = _run("chunk", [Request("r", _tokens(128), 0)], chunk=16, max_pending=2,
                  link_gbps=0.0003)
    span_bytes = TINY.geometry(16).region_bytes((0, TINY.layers), (0, 16))
    assert result.metrics["peak_staging_bytes"] == 2 * span_bytes
    assert any(e.kind == "stage" and e.name == "blocked" for e in result.events)
    h2d = [e.end - e.t for e in result.events if e.kind == "stage" and e.name == "h2d"]
    assert min(h2d) >= span_bytes / 0.0003e9 * 0.95
    assert _check(result).ok


def test_stage_events_cover_compute_and_every_copy_stage():
    """Each span has gather, d2h and h2d stages in order; compute stages precede them."""
    result = _run("layer", [Request("r", _tokens(60), 0)], chunk=16)
    stages = [e for e in result.events if e.kind == "stage"]
    for span in {e.span for e in result.events if e.kind == "issue"}:
        names = [s.name for s in stages if s.span == span]
        assert names == ["gather", "d2h", "h2d"]
    assert sum(s.name == "compute" for s in stages) == TINY.layers
    assert all(s.end >= s.t for s in stages)


@pytest.mark.parametrize("switch,code", sorted(DEBUG_BREAKS.items()))
def test_protocol_breaking_switch_is_caught_live_with_its_code(switch, code):
    """Each debug switch that breaks the protocol is stopped by the live check with its code."""
    with pytest.raises(Violation) as info:
        _run("chunk", [Request("r", _tokens(96), 0)], chunk=16, max_pending=1,
             link_gbps=0.001, debug=switch)
    assert info.value.code == code


def test_layer_mode_refused_for_recurrent_model_before_allocating():
    """CFG-1: layer mode on a recurrent geometry is refused at setup, nothing allocated."""
    model = build_model(attrs.evolve(TINY, recurrent=True), seed=0)
    engine = Engine(model, EngineConfig("layer", chunk=16))
    with pytest.raises(WorkloadError, match="CFG-1"):
        engine.run([Request("r", _tokens(32), 0)])
    assert not hasattr(engine, "source") and not hasattr(engine, "pool")


@pytest.mark.parametrize("kw,field", [
    (dict(chunk=0), "chunk"), (dict(max_pending=0), "max_pending"),
    (dict(pool_pages=1), "pool_pages"), (dict(link_gbps=0.0), "link_gbps"),
])
def test_bad_config_is_refused_naming_the_field(kw, field):
    """Bad engine settings raise WorkloadError naming the field, before allocation."""
    engine = Engine(MODELS["qwen3"], EngineConfig("chunk", **{"chunk": 16, **kw}))
    with pytest.raises(WorkloadError, match=field):
        engine.run([Request("r", _tokens(40), 0)])
    assert not hasattr(engine, "source")


def test_metrics_report_engine_figures():
    """Metrics carry DESIGN names plus copy-stage times, allocations and live-check cost."""
    m = _run("chunk", [Request("r", _tokens(64), 0)], chunk=16).metrics
    span_bytes = TINY.geometry(16).region_bytes((0, TINY.layers), (0, 16))
    assert m["bytes"] == 4 * span_bytes and m["spans"] == 4
    assert m["source_alloc_bytes"] == 2 * 2 * span_bytes  # gather + host, max_pending slots
    assert 0 < m["check_s"] < m["wall_s"]
    assert m["prefill_s"] <= m["handoff_s"] and m["tail_s"] >= 0
    assert all(m[k] > 0 for k in ("gather_s", "d2h_s", "h2d_s", "copy_s"))


def test_copy_bound_link_sets_handoff_and_max_pending_bounds_the_tail():
    """Copy-bound, each direction paced: handoff >= bytes/link; whole's tail is its d2h then
    its h2d; chunk's spans pipeline, so its tail is at most max_pending + 1 span-times of one
    direction (the producer blocked), far below whole's, and grows with the chunk size."""
    link = 0.0001  # GB/s: a 16-token tiny span (8 KiB) takes ~80 ms, compute ~1 ms a chunk
    # (slow enough that a loaded machine's scheduling delays stay well under a span-time)
    request = [Request("r", _tokens(128), 0)]
    with no_gc_pauses():
        runs = {m: _run(m, request, chunk=16, max_pending=2, link_gbps=link).metrics
                for m in ("whole", "chunk")}
        coarse = _run("chunk", request, chunk=64, max_pending=2, link_gbps=link).metrics
    total = runs["whole"]["bytes"]
    span_s = total / 8 / (link * 1e9)
    for m in runs.values():
        assert m["handoff_s"] >= total / (link * 1e9) * 0.95
    assert runs["whole"]["tail_s"] >= 2 * 8 * span_s * 0.95
    assert runs["chunk"]["tail_s"] <= (2 + 1) * span_s + 0.5 * span_s
    assert runs["chunk"]["blocked_s"] > 0
    assert coarse["tail_s"] > 1.5 * runs["chunk"]["tail_s"]  # bigger spans, longer tail


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_warm_up_leaves_results_identical_and_the_trace_starts_at_zero(mode):
    """The warm-up (one chunk of prefill, one copy per staging slot) changes no result: same
    first token and decoder KV as a cold run, the pool and source caches zeroed again, its
    pages given back; the warmed trace starts with a reserve at t >= 0 and checks ok."""
    requests = [Request("a", _tokens(100, seed=4), 16), Request("b", _tokens(90, seed=5), 0)]
    cold = _run(mode, requests, chunk=24, max_pending=2, warmup=False)
    engine = Engine(MODELS["qwen3"], EngineConfig(mode, chunk=24, max_pending=2, keep_kv=True))
    warm = engine.run(requests)
    for a, b in zip(warm.outcomes, cold.outcomes, strict=True):
        assert a.first_token == b.first_token and torch.equal(a.kv, b.kv)
    assert warm.metrics["warmup_s"] > 0 and cold.metrics["warmup_s"] is None
    assert warm.events[0].kind == "reserve" and warm.events[0].t >= 0
    assert all(e.t >= 0 for e in warm.events)
    assert [e.kind for e in warm.events].count("reserve") == 2  # nothing of the warm-up
    assert min(e.span for e in warm.events if e.kind == "issue") == 0
    assert _check(warm).ok
    assert engine.source.pool.allocate(1)[1] == (0,)  # every source page given back


def test_warm_up_zeroes_the_caches_it_used():
    """After the warm-up alone, the decoder pool and the source cache hold zeros again."""
    engine = Engine(MODELS["qwen3"], EngineConfig("whole", chunk=32))
    request = Request("r", _tokens(64), 0)
    plan = setup_check(MODELS["qwen3"].spec, engine.config, [request])
    rec = Recorder(engine._header(plan.pool_pages))
    engine._allocate(plan, rec)
    try:
        engine._warm_up([request])
    finally:
        engine.copier.close()
        rec.stop()
    assert not engine.pool.kv.any() and not engine.source.kv.any()
    assert all(ring.host.abs().sum() > 0 for ring in engine.copier.rings)  # touched


@contextmanager
def _engine_with_ledger(mode="chunk", prompt=64, **kw):
    """An engine with its buffers, copier and Ledger set up (no request served yet); on the
    way out its copier is closed and its recorder's audit thread stopped (a run cut short
    never closes its recorder, and a test's exception keeps it alive until collected)."""
    engine = Engine(MODELS["qwen3"], EngineConfig(mode, chunk=16, **kw))
    request = Request("r", _tokens(prompt), 0)
    plan = setup_check(MODELS["qwen3"].spec, engine.config, [request])
    rec = Recorder(engine._header(plan.pool_pages))
    try:
        engine._allocate(plan, rec)
        engine.ledger = EngineLedger(rec, engine.source, engine.pool, engine.copier,
                                     engine.geometry, engine.faults)
        yield engine, rec, request
    finally:
        if getattr(engine, "copier", None) is not None:
            engine.copier.close()
        rec.stop()


def test_freeing_source_pages_under_a_copy_in_flight_is_refused_before_freeing():
    """EngineLedger.free_source emits `reuse` first: with a span in flight it is COPY-3, live, and
    the source pages are still held afterwards."""
    with _engine_with_ledger(link_gbps=0.0002) as (engine, rec, request):
        src = engine.source.open(request.prompt)
        life = engine.ledger.reserve(request, src, torch.tensor(request.tokens))
        engine.ledger.computed("r", (0, TINY.layers), (0, 16))
        engine.ledger.issue(life, Region((0, TINY.layers), (0, 16)), engine.copier.mark_ready())
        free_before = engine.source.pool.free_pages
        with pytest.raises(Violation) as info:
            engine.ledger.free_source(life)
        assert info.value.code == "COPY-3"
        assert engine.source.pool.free_pages == free_before
        assert engine.copier.drain(timeout=60), "spans never reported within 60 s"


def test_live_check_cost_times_every_call_into_the_monitor():
    """Every protocol and stage event of the run went through a timed Monitor call (queries
    come on top), and the seconds of those calls are a part of the run."""
    result = _run("chunk", [Request("r", _tokens(64), 0)], chunk=16)
    m = result.metrics
    assert m["checks"] >= len(result.events)
    assert 0 < m["check_s"] < m["wall_s"]
    assert m["check_frac"] == pytest.approx(m["check_s"] / m["wall_s"])


def test_issue_pdref_never_allows_with_nothing_in_flight_is_refused_not_hung():
    """When pdref refuses every issue and no copy is in flight (nothing will ever land), the
    producer stops with EngineError instead of waiting for ever."""
    asked = []
    with _engine_with_ledger() as (engine, rec, _):
        rec.ask = lambda query, *args: asked.append(query) and False
        with pytest.raises(EngineError, match="refuses an issue"):
            engine._wait_for_slot(rec, "r")
    assert asked == ["can_issue"]


def test_computed_waits_for_the_steps_readiness_mark():
    """`computed` (and the span it readies) comes only once the step's readiness mark is done:
    a launched step whose mark is pending emits nothing yet."""
    with _engine_with_ledger() as (engine, rec, request):
        src = engine.source.open(request.prompt)
        tokens = torch.tensor(request.tokens)
        loop = Loop(engine.ledger.reserve(request, src, tokens),
                     Prefill(engine.model, tokens, 0, 16, src))
        step = plan_steps("chunk", engine.geometry, request.prompt, 0, 16)[0]
        end = HostMark(rec.now)
        loop.pending.append(Pending(step, HostMark.now(rec.now), end))
        engine._emit_computed(rec, loop)
        assert not any(e.kind == "computed" for e in rec.protocol) and not loop.ready
        end.set()
        engine._emit_computed(rec, loop)
        assert [e.kind for e in rec.protocol].count("computed") == 1
        assert [r for r, _ in loop.ready] == list(step.spans)


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_engine_computes_and_issues_in_the_step_schedule(mode):
    """The trace's `computed` regions are plan_steps' steps in order and its `issue` regions
    the spans they make ready, in order."""
    result = _run(mode, [Request("r", _tokens(70), 16)], chunk=24)
    steps = plan_steps(mode, TINY.geometry(16), 70, 16, 24)
    computed = [(e.layers, e.tokens) for e in result.events if e.kind == "computed"]
    issued = [(e.layers, e.tokens) for e in result.events if e.kind == "issue"]
    assert computed == [(s.layers, s.tokens) for s in steps]
    assert issued == [(r.layers, r.tokens) for s in steps for r in s.spans]


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_export_only_lands_the_payload_byte_exact(mode):
    """--no-compute: the payload, not a prefill, is handed off in the mode's spans; the
    decoder's slab holds it exactly, and the trace checks."""
    result = _run(mode, [Request("r", (0,) * 90, 16)], chunk=32, no_compute=True)
    kv = result.outcomes[0].kv  # [L, 2, 74, KVH, D]
    for layer in range(TINY.layers):
        want = payload_values(layer, (16, 90), kv.dtype, kv.device)[0, :, 0, 0]  # [74]
        assert torch.equal(kv[layer, :, :, :, :], want.view(1, -1, 1, 1).expand_as(kv[layer]))
    assert result.outcomes[0].first_token is None and result.metrics["first_token"] is None
    assert [e.kind for e in result.events].count("computed") == 1
    assert _check(result).ok


def test_payload_check_catches_a_misplaced_token():
    """payload_matches refuses a slab where one token's K/V is another token's payload."""
    with _engine_with_ledger(prompt=40) as (engine, rec, request):
        slab = engine.pool.slab(tuple(range(3)), 0, 40)
        src = engine.source.open(40)
        fill_payload(src, (0, TINY.layers), (0, 40))
        engine.pool.kv.index_copy_(2, slab.slots, engine.source.kv.index_select(2, src.slots))
        every = kv_groups(engine.geometry, (0, TINY.layers), (0, 40), 40, 0)
        assert payload_matches(engine.pool, slab, every, None)
        engine.pool.kv[1, 0, int(slab.slots[7])] = engine.pool.kv[1, 0, int(slab.slots[8])]
        assert not payload_matches(engine.pool, slab, every, None)


def test_failure_path_fences_before_abort_and_pages_follow_the_spec():
    """A failed span: `fail`, then (version 2) `fence` of that span, then `abort` and the
    retry; the decoder pool holds no page at the end, as the specification's pool."""
    engine = Engine(MODELS["qwen3"], EngineConfig("chunk", chunk=16, keep_kv=True,
                                                  fail_span=1, link_gbps=0.001))
    result = engine.run([Request("r", _tokens(96), 0)])
    kinds = [e.kind for e in result.events if e.kind != "stage"]
    assert result.header.version == 2
    assert kinds.index("fail") < kinds.index("fence") < kinds.index("abort")
    fence = next(e for e in result.events if e.kind == "fence")
    assert fence.span == next(e for e in result.events if e.kind == "fail").span
    assert kinds.index("abort") < len(kinds) - 1 - kinds[::-1].index("reserve")
    assert engine.pool.held == frozenset()
    assert _check(result).ok


def test_decoder_pool_takes_only_free_pages_and_follows_the_spec():
    """take() refuses a page still held; follow() gives back only pages the spec has free."""
    pool = DecoderPool(TINY.geometry(16), 4, "cpu", torch.float32)
    pool.take((0, 1))
    with pytest.raises(RuntimeError, match="page 1"):
        pool.take((1, 2))
    assert pool.follow((0, 3)) == (0,)
    assert pool.held == frozenset({1})
    pool.take((0, 2))
    assert pool.held == frozenset({0, 1, 2})


class LaggingDevice:
    """Readiness marks that complete `lag` s after they are recorded, in record order: a
    device running behind the host, as CUDA's compute stream does (the host only launches)."""

    def __init__(self, lag: float) -> None:
        self.lag, self.marks = lag, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def mark_ready(self, backend):
        mark = HostMark(backend.clock)
        self.marks.put((time.perf_counter() + self.lag, mark))
        return mark

    def _run(self) -> None:
        while (item := self.marks.get()) is not None:
            due, mark = item
            time.sleep(max(0.0, due - time.perf_counter()))
            mark.set()

    def close(self) -> None:
        """Stop the device thread (after the marks already recorded) and wait for it."""
        self.marks.put(None)
        self.thread.join(30)
        assert not self.thread.is_alive(), "the lagging device never stopped"


@pytest.fixture
def lagging_device():
    """Makes LaggingDevices for the test; their threads are stopped after it."""
    made = []

    def make(lag: float) -> LaggingDevice:
        made.append(LaggingDevice(lag))
        return made[-1]
    yield make
    for device in made:
        device.close()


def test_host_running_ahead_emits_computed_late_and_still_overlaps(monkeypatch, lagging_device):
    """With readiness marks completing behind the host, each `computed` comes after its
    step's mark, spans go out as their steps complete (the first before the last step is
    done), and the handoff is still exact and checks."""
    device = lagging_device(0.02)
    monkeypatch.setattr(Backend, "mark_ready", lambda backend: device.mark_ready(backend))
    request = [Request("r", _tokens(96), 0)]
    lagging = _run("chunk", request, chunk=16)
    monkeypatch.undo()
    plain = _run("chunk", request, chunk=16)
    events = lagging.events
    computes = [e for e in events if e.kind == "stage" and e.name == "compute"]
    computed = [e for e in events if e.kind == "computed"]
    assert all(c.t >= s.end for s, c in zip(computes, computed, strict=True))
    first_issue = next(e.t for e in events if e.kind == "issue")
    assert first_issue < computed[-1].t
    assert torch.equal(lagging.outcomes[0].kv, plain.outcomes[0].kv)
    assert _check(lagging).ok


def test_step_loop_never_waits_for_a_readiness_mark_while_steps_remain(monkeypatch,
                                                                     lagging_device):
    """With a device running behind the host, the compute thread launches every step without
    waiting for any step's readiness mark (only the lanes wait for them); it may wait once
    the last step is launched. The CPU analog of the CUDA test that the host never
    synchronizes in the step loop."""
    device = lagging_device(0.05)
    monkeypatch.setattr(Backend, "mark_ready", lambda backend: device.mark_ready(backend))
    launched, waits, steps = [0], [], 96 // 16
    compute, wait = Engine._compute, HostMark.wait

    def counting(self, loop, step):
        compute(self, loop, step)
        launched[0] += 1

    def logged(mark):
        waits.append((threading.current_thread().name, launched[0]))
        wait(mark)

    monkeypatch.setattr(Engine, "_compute", counting)
    monkeypatch.setattr(HostMark, "wait", logged)
    result = _run("chunk", [Request("r", _tokens(96), 0)], chunk=16)
    assert launched[0] == steps and _check(result).ok
    assert [w for w in waits if w[0] == "MainThread" and 0 < w[1] < steps] == []
    assert any(name == "pdgpu-gather" for name, _ in waits)


def test_abort_is_refused_while_a_failed_span_is_unfenced():
    """EngineLedger.abort refuses to abort a life whose failed span's writer was not fenced (the
    pages must not go back while a writer may still write them); nothing is scrubbed."""
    with _engine_with_ledger(link_gbps=0.0002) as (engine, rec, request):
        src = engine.source.open(request.prompt)
        life = engine.ledger.reserve(request, src, torch.tensor(request.tokens))
        engine.ledger.computed("r", (0, TINY.layers), (0, 16))
        span = engine.ledger.issue(life, Region((0, TINY.layers), (0, 16)),
                                   engine.copier.mark_ready())
        rec.emit(ev.Fail, "r", span, "lost track of the writer")  # no fence
        with pytest.raises(RuntimeError, match="unfenced"):
            engine.ledger.abort(life, "test")
        assert not any(e.kind == "abort" for e in rec.protocol)
        assert not engine.pool.kv.isnan().any()
        assert engine.copier.drain(timeout=60), "spans never reported within 60 s"
