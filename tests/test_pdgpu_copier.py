"""pdgpu.copier, source cache and decoder pool: the bytes a span moves and the worker's rules."""

from __future__ import annotations

import time

import pytest
import torch

from pdgpu.copier import Copier, CopierConfig, CopyJob, measure_copy_bandwidth
from pdgpu.decoder_pool import DecoderPool
from pdgpu.source_cache import SourceCache, gather, token_slots
from pdref.geometry import Geometry

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


def _copier(slots=2, link=None, span_elems=3 * 2 * 8 * 2 * 4):
    source, request = _filled_source()
    pool = DecoderPool(GEO, 8, "cpu", torch.float32)
    start = time.perf_counter()
    copier = Copier(CopierConfig(slots, span_elems, link), source.kv, pool,
                    lambda: time.perf_counter() - start)
    return copier, source, request, pool


def _job(copier, request, slab, span, tokens, fail=False):
    return CopyJob(span, "r", (0, 3), tokens, request.slots, slab, copier.mark_ready(), fail)


def test_copier_moves_spans_into_the_decoder_in_order():
    """Spans submitted to the worker land byte-exact in the slab, results in order."""
    copier, source, request, pool = _copier()
    slab = pool.slab((4, 0, 7, 2, 5), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8)))
        copier.submit(_job(copier, request, slab, 1, (8, 16)))
        results = [copier.wait(), copier.wait()]
    finally:
        copier.close()
    assert [r.job.span for r in results] == [0, 1] and all(r.error is None for r in results)
    assert [s.name for s in results[0].stages] == ["gather", "d2h", "h2d"]
    assert torch.equal(pool.read_slab(slab)[:, :, :16], source.kv[:, :, request.slots[:16]])


def test_copier_refuses_more_than_its_ring():
    """A third span with two staging buffers in use is refused, not queued."""
    copier, _, request, pool = _copier(slots=2, link=0.0001)
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 4)))
        copier.submit(_job(copier, request, slab, 1, (4, 8)))
        with pytest.raises(RuntimeError, match="max_pending"):
            copier.submit(_job(copier, request, slab, 2, (8, 12)))
        assert len(copier.drain()) == 2 and copier.in_flight == 0
    finally:
        copier.close()


def test_injected_fault_is_reported_not_raised():
    """A failing copy comes back as a result with the error; the worker keeps working."""
    copier, _, request, pool = _copier()
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8), fail=True))
        copier.submit(_job(copier, request, slab, 1, (8, 16)))
        failed, ok = copier.wait(), copier.wait()
    finally:
        copier.close()
    assert "injected fault on span 0" in failed.error and ok.error is None


def test_link_pacing_stretches_the_h2d_stage():
    """At link_gbps the h2d stage lasts at least bytes / bandwidth."""
    copier, _, request, pool = _copier(link=0.001)
    slab = pool.slab((0, 1, 2, 3, 4), 0, 20)
    try:
        copier.submit(_job(copier, request, slab, 0, (0, 8)))
        result = copier.wait()
    finally:
        copier.close()
    h2d = next(s for s in result.stages if s.name == "h2d")
    assert h2d.end - h2d.start >= 3 * 2 * 8 * 2 * 4 * 4 / 1e6 * 0.95


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
