"""pdgpu.serve.ledger: each decoder resource operation is its pdref event, refused with
nothing done when pdref refuses it."""

from __future__ import annotations

import pytest
import torch

from pdgpu.serve.digest import row_digests
from pdgpu.serve.ledger import Ledger
from pdgpu.serve.tracelog import TraceLog
from pdref import events as ev
from pdref.geometry import Geometry
from pdref.violations import Violation

GEO = Geometry(layers=2, kv_heads=2, head_dim=4, dtype_bytes=4, page_tokens=4)


@pytest.fixture
def ledger(tmp_path):
    """A ledger over a 4-page pool, its audit thread stopped at teardown (a test's exception
    info keeps the ledger alive, and its thread running, until collected)."""
    header = ev.Header("test", "chunk", GEO, 4, 2)
    made = Ledger(header, "cpu", torch.float32, TraceLog(header, tmp_path / "t.jsonl"))
    yield made
    made.stop()


def _span(ledger: Ledger, req: str, tokens) -> tuple[int, torch.Tensor]:
    ledger.computed(req, (0, 2), tokens)
    n = tokens[1] - tokens[0]
    span = ledger.issue(req, (0, 2), tokens, GEO.region_bytes((0, 2), tokens))
    return span, torch.randn(2, 2, n, 2, 4)  # [nl, 2, nt, KVH, D]


def test_landed_bytes_are_what_admit_hands_to_decoding(ledger):
    """Two spans land; the admitted context is the prefix cache then exactly their bytes."""
    ledger.reserve("r", 8, 0, "p1")
    parts = []
    for tokens in ((0, 4), (4, 8)):
        span, kv = _span(ledger, "r", tokens)
        assert ledger.land("r", span, kv, row_digests(kv)) is None
        parts.append(kv)
    ledger.produced("r", 3)
    ledger.reuse("r", (0, 8))
    context = ledger.admit("r")
    assert torch.equal(context.kv.index_select(2, context.slots), torch.cat(parts, dim=2))


def test_a_span_landing_twice_or_over_landed_tokens_writes_nothing(ledger):
    """A second land is REQ-1 and a span over landed tokens is COV-2: slab bytes unchanged."""
    ledger.reserve("r", 4, 0, "p1")
    span, kv = _span(ledger, "r", (0, 4))
    ledger.land("r", span, kv, None)
    before = ledger.kv_landing.kv.clone()
    with pytest.raises(Violation) as again:
        ledger.land("r", span, torch.ones_like(kv), None)
    assert again.value.code == "REQ-1"
    other, _ = _span(ledger, "r", (0, 4))
    with pytest.raises(Violation) as overlap:
        ledger.land("r", other, torch.ones_like(kv), None)
    assert overlap.value.code == "COV-2"
    assert torch.equal(ledger.kv_landing.kv, before)


def test_a_checksum_mismatch_is_fail_then_fence_and_never_admitted(ledger):
    """Bytes that differ from the compute-time digests: fail + fence; admit refused; the
    abort gives every page back."""
    ledger.reserve("r", 4, 0, "p1")
    span, kv = _span(ledger, "r", (0, 4))
    digests = row_digests(kv)
    kv[1, 0, 3] += 1.0  # the copy changed one row on the way
    error = ledger.land("r", span, kv, digests)
    assert error == "checksum mismatch at layer 1 token 3"
    assert [e.kind for e in list(ledger.recent)[-2:]] == ["fail", "fence"]
    ledger.produced("r", 1)
    with pytest.raises(Violation) as refused:
        ledger.admit("r")
    assert refused.value.code == "ADM-1"
    ledger.reuse("r", (0, 4))
    ledger.abort("r", "copy failed")
    assert ledger.used_pages == 0 and ledger.peak_pages == 1
    ledger.close()  # LIFE-1: nothing held, nothing unfenced; the audit agrees


def test_the_trace_log_writes_in_time_order_and_clamps_only_overlong_stages(tmp_path):
    """Stages reported after later protocol events are merged by time within the window; a
    stage older than what was written is written at that time and counted."""
    header = ev.Header("test", "chunk", GEO, 4, 2)
    log = TraceLog(header, tmp_path / "t.jsonl", window_s=1.0)
    log.add(ev.Reserve(0.5, "r", 4, 0, (0,), "p1"))
    log.add(ev.Stage(0.2, "r", "compute", 0.6))  # started before the reserve was written
    log.add(ev.Computed(3.0, "r", (0, 2), (0, 4)))  # writes what is older than 2.0
    log.add(ev.Stage(0.1, "r", "gather", 3.0))  # older than what was written: clamped
    log.close()
    lines = [line.split('"kind":"')[1].split('"')[0] + "@" + line.split('"t":')[1].split(",")[0]
             for line in (tmp_path / "t.jsonl").read_text().splitlines()[1:]]
    assert lines == ["stage@0.2", "reserve@0.5", "stage@0.5", "computed@3.0"]
    assert log.stages_clamped == 1
    assert [e.kind for e in log.protocol()] == ["reserve", "computed"]
