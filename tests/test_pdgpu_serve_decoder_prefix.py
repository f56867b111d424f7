"""The decoder's automatic prefix cache (serve/decoder_prefix.py) over a ledger in this
process: a later request hits the whole chunks an earlier one cached, its context is those
pages' bytes then its own slab's, idle pages are evicted least recently used first and only
when nobody holds them, and every event is checked live by pdref (version 4)."""

from __future__ import annotations

import json

import pytest
import torch

from pdgpu.handoff import kv_groups
from pdgpu.serve.decoder_prefix import DecoderPrefix
from pdgpu.serve.digest import row_digests
from pdgpu.serve.ledger import Ledger
from pdgpu.serve.tracelog import TraceLog
from pdref import events as ev
from pdref.check import check_lines
from pdref.geometry import Geometry
from pdref.kinds import LayerKind

GEO = Geometry(layers=2, kv_heads=2, head_dim=4, dtype_bytes=4, page_tokens=4)
# a sliding layer (window 6) then a full one, as Gemma 3's
SLIDING = Geometry(2, 2, 4, 4, 4, False, (LayerKind("sliding", 6), LayerKind("full")))
CHUNK = 4


def _ledger(tmp_path, geometry: Geometry, pages: int) -> Ledger:
    header = ev.Header("test", "chunk", geometry, pages, 4, version=ev.CACHE_VERSION)
    return Ledger(header, "cpu", torch.float32, TraceLog(header, tmp_path / "t.jsonl"))


@pytest.fixture
def ledger(tmp_path):
    """A version 4 ledger over a 6-page pool (its audit stopped at teardown)."""
    made = _ledger(tmp_path, GEO, 6)
    yield made
    made.stop()


def _serve_one(ledger: Ledger, cache: DecoderPrefix, req: str, tokens: list[int]) -> dict:
    """Reserve (with the cache's hit), land its suffix in one span (a sliding layer's
    window only), admit and publish; the hit, the prefix, the landed groups' K/V and the
    context's bytes [L, 2, prompt, KVH, D]."""
    geo, prompt = ledger.geometry, len(tokens)
    hit = cache.lookup(tokens)
    prefix = len(hit) * geo.page_tokens
    assert cache.room(req, geo.pages_for(prompt - prefix), hit)
    ledger.reserve(req, prompt, prefix, "p1", hit or None)
    cache.reserved(req, prompt, hit)
    ledger.computed(req, (0, 2), (prefix, prompt))
    span = ledger.issue(req, (0, 2), (prefix, prompt),
                        geo.span_bytes((0, 2), (prefix, prompt), prompt, prefix))
    payload = []
    for (l0, l1), (a, b) in kv_groups(geo, (0, 2), (prefix, prompt), prompt, prefix):
        kv = torch.randn(l1 - l0, 2, b - a, 2, 4)  # [nl, 2, nt, KVH, D]
        payload += [kv, row_digests(kv)]
    assert ledger.land(req, span, *payload) is None
    ledger.produced(req, 1)
    ledger.reuse(req, (prefix, prompt))
    context = ledger.admit(req)
    cache.publish(req, tokens, prefix, ledger.slabs[req])
    return {"hit": hit, "prefix": prefix, "suffix": payload[0],
            "context": context.kv.index_select(2, context.slots)}


def _trace_ok(ledger: Ledger) -> list[dict]:
    """The run's trace, legal under pdref check: its events."""
    ledger.close()
    ledger.log.close()
    lines = ledger.log.path.read_bytes().splitlines()
    verdict = check_lines(lines, "trace")
    assert verdict.ok, (verdict.code, verdict.line, verdict.message)
    return [json.loads(line) for line in lines[1:]]


def test_a_later_request_hits_the_whole_chunks_an_earlier_one_cached(ledger):
    """b shares a's first 9 tokens: it hits a's two whole pages (8 tokens, whole chunks),
    only [8, 14) lands, and its context is a's bytes of [0, 8) then its own; the trace is
    legal version 4, and drained at the end every page is free."""
    cache = DecoderPrefix(ledger, CHUNK, budget=6)
    a = list(range(12))
    first = _serve_one(ledger, cache, "a", a)
    assert first["hit"] == () and len(cache.index) == 3  # [0, 12): three whole chunks
    ledger.release("a")
    second = _serve_one(ledger, cache, "b", a[:9] + [90, 91, 92, 93, 94])
    assert second["prefix"] == 8 and len(second["hit"]) == 2
    assert torch.equal(second["context"][:, :, :8], first["suffix"][:, :, :8])
    assert torch.equal(second["context"][:, :, 8:], second["suffix"])
    ledger.release("b")
    cache.drain()
    assert ledger.leaked_pages == 0 and len(cache.index) == 0
    kinds = [e["kind"] for e in _trace_ok(ledger)]
    assert kinds.count("cache") == 2 and kinds[-1] == "evict"


def test_the_hit_leaves_one_prompt_token_to_compute(ledger):
    """A prompt that is all cached pages hits one chunk fewer: a token is computed."""
    cache = DecoderPrefix(ledger, CHUNK, budget=6)
    _serve_one(ledger, cache, "a", list(range(8)))
    ledger.release("a")
    again = _serve_one(ledger, cache, "b", list(range(8)))
    assert again["prefix"] == 4
    ledger.release("b")
    _trace_ok(ledger)


def test_idle_pages_are_evicted_least_recently_used_first_and_held_ones_never(ledger):
    """The pool (6 pages) is short for c: a's idle cached pages go, last page first; while
    b holds the pages it hit, nothing evicts them and c waits."""
    cache = DecoderPrefix(ledger, CHUNK, budget=6)
    _serve_one(ledger, cache, "a", list(range(12)))  # 3 pages cached, held by a
    ledger.release("a")
    b = _serve_one(ledger, cache, "b", list(range(8)) + [50])  # hits 2, holds them
    assert not cache.room("c", 5, ())  # only a's third page is idle: 3 free at most
    assert ledger.free_pages() == 3  # b's slab holds one page, its hit two
    ledger.release("b")
    assert cache.room("c", 5, ())
    evicts = [e for e in _trace_ok(ledger) if e["kind"] == "evict"]
    assert [len(e["pages"]) for e in evicts] == [1, 1]
    assert evicts[0]["pages"][0] not in b["hit"]  # a's third page went first
    assert evicts[1]["pages"][0] == b["hit"][1]  # then b's last hit page (its run's tail)


def test_publishing_keeps_within_the_budget(ledger):
    """A budget of 2 pages: a caches 2 of its 3 whole pages; b's new pages evict a's idle
    ones to fit (least recently used first), never beyond the budget."""
    cache = DecoderPrefix(ledger, CHUNK, budget=2)
    _serve_one(ledger, cache, "a", list(range(12)))
    assert len(cache.index) == 2
    ledger.release("a")
    _serve_one(ledger, cache, "b", list(range(100, 108)))
    assert len(cache.index) == 2
    ledger.release("b")
    _trace_ok(ledger)


def test_a_page_below_a_sliding_window_serves_only_a_later_window(tmp_path):
    """a (20 tokens, window 6) caches [0, 12) without its sliding layer's KV (its slab holds
    that layer's [12, 20) only): b (14 tokens, window from 8) hits [0, 8) only, c (32 tokens,
    window from 24) all of [0, 12); both legal under CACHE-1, their full layer's rows a's."""
    ledger = _ledger(tmp_path, SLIDING, 16)
    try:
        cache = DecoderPrefix(ledger, CHUNK, budget=16)
        first = _serve_one(ledger, cache, "a", list(range(20)))
        ledger.release("a")
        short = _serve_one(ledger, cache, "b", list(range(12)) + [90, 91])
        long = _serve_one(ledger, cache, "c", list(range(12)) + list(range(100, 120)))
        assert (short["prefix"], long["prefix"]) == (8, 12)
        full = first["context"][1]  # [2, 20, KVH, D]: the full layer
        assert torch.equal(long["context"][1, :, :12], full[:, :12])
        ledger.release("b")
        ledger.release("c")
        cache.drain()
        _trace_ok(ledger)
    finally:
        ledger.stop()
