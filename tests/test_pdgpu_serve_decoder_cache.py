"""pdgpu serve's decoder-side prefix cache (`--prefix-cache`, contract v4): a request whose
leading whole chunks the decoder's pool holds reserves them as its `hit`, only the rest of
its prompt crosses, its tokens stay those of `generate` without any cache, the trace is
legal (pdref check, version 4) and ends with every page free, under faults too."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest
from serve_helpers import drawn_prompts, events_of, serve, trace_ok, write_sensitive_checkpoint

# the producer's cache tests' geometry and their cached reference (generate, no cache)
from test_pdgpu_serve_prefix_cache import CHUNK, PAGE, SHARED, _reference

from pdgpu import prefix_index
from pdgpu.handoff import handoff_geometry
from pdgpu.serve.decoder_prefix import DecoderPrefix
from pdgpu.serve.models import model_spec


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_sensitive_checkpoint(tmp_path_factory.mktemp("ckpt") / "sensitive"))


def _prompts(path, count: int, out: int) -> list[dict]:
    """Prompts sharing SHARED leading tokens; every third one repeats an earlier prompt."""
    lines = drawn_prompts(path, count, [70, 90, 50, 81], 256, SHARED, out)
    for i in range(2, count, 3):
        lines[i] = {**lines[i - 2], "req": f"q{i}"}
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def _serve(tmp_path, capsys, checkpoint, lines, *args):
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--prompts", str(tmp_path / "p.jsonl"), "--chunk",
        str(CHUNK), "--page-tokens", str(PAGE), "--json", *args)
    summary = json.loads(capsys.readouterr().out)
    trace_ok(trace)
    assert summary["leaked_pages"] == 0
    return code, results, trace, summary


def _assert_tokens(checkpoint, lines, results, out: int) -> None:
    for line, r in zip(lines, results, strict=True):
        if r["status"] == "ok":
            assert r["output"] == _reference(checkpoint, tuple(line["tokens"]), out), r["req"]


def _decoder_hits(trace) -> list[dict]:
    return [e for e in events_of(trace, "reserve") if e.get("hit")]


def _kv_bytes(model: str, prompt: int, prefix: int) -> int:
    """What the K/V spans of a life over [prefix, prompt) carry (a sliding layer: its window;
    a linear layer none)."""
    geometry = handoff_geometry(model_spec(model, None), PAGE)
    return geometry.span_bytes((0, geometry.layers), (prefix, prompt), prompt, prefix)


@pytest.mark.parametrize(("model", "mode", "producers"),
                         [("sensitive", "chunk", 1), ("sensitive", "whole", 2),
                          ("sensitive", "layer", 1), ("tiny-gemma3", "chunk", 1),
                          ("tiny-gemma3", "layer", 2), ("tiny-qwen3.5", "chunk", 1),
                          ("tiny-qwen3.5", "whole", 2)])
def test_decoder_hits_keep_tokens_and_only_the_rest_crosses(tmp_path, capsys, checkpoint,
                                                            model, mode, producers):
    """A shared system prompt and repeated prompts: later requests hit the decoder's cached
    whole chunks (at least one prompt token left to compute; Gemma 3: no page without its
    sliding KV that their windows need; Qwen3.5: no state needed), every token equals
    generate's without a cache, and the K/V spans carry exactly each life's [prefix, prompt):
    the hits' bytes never cross."""
    model = checkpoint if model == "sensitive" else model
    lines = _prompts(tmp_path / "p.jsonl", 7, 4)
    code, results, trace, summary = _serve(tmp_path, capsys, model, lines, "--mode", mode,
                                     "--producers", str(producers), "--concurrency", "2",
                                     "--prefix-cache")
    assert code == 0 and json.loads(trace[0])["version"] == 4
    _assert_tokens(model, lines, results, 4)
    hits = _decoder_hits(trace)
    assert len(hits) >= 3 and all(e["prefix"] % CHUNK == 0 for e in hits)
    assert all(e["prefix"] < e["prompt"] and len(e["hit"]) * PAGE == e["prefix"] for e in hits)
    repeated = {e["req"]: e["prefix"] for e in hits}
    assert repeated.get("q2", 0) >= SHARED  # a repeated prompt hits past the system prompt
    crossed = sum(e["bytes"] for e in events_of(trace, "issue") if not e.get("state"))
    reserves = events_of(trace, "reserve")
    assert summary["decoder_cache_hits"] == sum(e["prefix"] for e in reserves)
    assert summary["decoder_cache_queries"] == sum(len(x["tokens"]) for x in lines)
    assert crossed == sum(_kv_bytes(model, e["prompt"], e["prefix"]) for e in reserves)
    assert crossed < sum(_kv_bytes(model, len(x["tokens"]), 0) for x in lines)
    assert events_of(trace, "cache") and events_of(trace, "evict")  # drained at the end


def test_a_small_pool_evicts_idle_pages_and_serves_on(tmp_path, capsys, checkpoint):
    """A pool of 24 pages and a decoder budget of 8: idle cached pages are evicted for slabs
    and for new pages, least recently used first; tokens unchanged, the trace legal."""
    lines = _prompts(tmp_path / "p.jsonl", 8, 3)
    code, results, trace, _ = _serve(tmp_path, capsys, checkpoint, lines, "--prefix-cache",
                                     "--pool-pages", "24", "--decoder-cache-pages", "8",
                                     "--concurrency", "2")
    assert code == 0
    _assert_tokens(checkpoint, lines, results, 3)
    decoder = [e for e in events_of(trace, "evict") if e.get("producer") is None]
    assert len(decoder) >= 2 and _decoder_hits(trace)


def test_faults_never_cache_a_page_with_wrong_bytes(tmp_path, capsys, checkpoint):
    """Failed, corrupted (`--verify`) and cancelled spans and a killed, restarted producer:
    the decoder caches only pages of admitted lives (never one with a failed span), later
    hits on them decode generate's tokens, the trace is legal and no page is left."""
    lines = _prompts(tmp_path / "p.jsonl", 18, 3)
    code, results, trace, summary = _serve(
        tmp_path, capsys, checkpoint, lines, "--prefix-cache", "--producers", "2",
        "--concurrency", "3", "--fail-rate", "0.1", "--corrupt-rate", "0.1", "--cancel-rate",
        "0.05", "--kill-producer", "0@0.3", "--restart-producers", "--link-gbps", "0.001",
        "--verify")
    assert events_of(trace, "fail") and summary["producer_restarts"] == 1
    _assert_tokens(checkpoint, lines, results, 3)
    assert _decoder_hits(trace)
    events = [json.loads(x) for x in trace[1:]]
    for i, e in enumerate(events):
        if e["kind"] == "cache" and e.get("producer") is None:
            life = [x["kind"] for x in events[:i] if x.get("req") == e["req"]]
            since = life[len(life) - 1 - life[::-1].index("reserve"):]
            assert "admit" in since and "fail" not in since, e
    assert code == (1 if summary["failed"] else 0)


def test_decoder_cache_pages_needs_the_cache(tmp_path, capsys):
    """--decoder-cache-pages with --no-prefix-cache: one line, exit 2."""
    from pdgpu.cli import main
    assert main(["serve", "--requests", "2", "--no-progress", "--no-prefix-cache",
                 "--decoder-cache-pages", "4"]) == 2
    err = capsys.readouterr().err
    assert "decoder-cache-pages: needs the prefix cache" in err and err.count("\n") == 1


def test_a_waiting_request_is_hashed_once_however_many_turns_it_waits(tmp_path, capsys,
                                                                       checkpoint, monkeypatch):
    """A pool of one slab: each request waits for room many scheduling turns (looked up on
    each), yet the decoder hashes each of its prompt's pages once (its kept key chain), the
    look-ups and the publishing of its pages included; tokens unchanged."""
    calls, lookups = [], []
    real_hash, real_lookup = hashlib.blake2b, DecoderPrefix.lookup
    monkeypatch.setattr(prefix_index, "hashlib", SimpleNamespace(
        blake2b=lambda data, **kw: calls.append(data) or real_hash(data, **kw)))
    monkeypatch.setattr(DecoderPrefix, "lookup",
                        lambda self, tokens: lookups.append(1) or real_lookup(self, tokens))
    lines = _prompts(tmp_path / "p.jsonl", 5, 4)
    code, results, trace, _ = _serve(tmp_path, capsys, checkpoint, lines, "--prefix-cache",
                                     "--pool-pages", "12", "--concurrency", "5")
    assert code == 0
    _assert_tokens(checkpoint, lines, results, 4)
    assert len(lookups) >= 2 * len(lines)  # the heads waited while others decoded
    asked = [max((len(x["tokens"]) - 1) // PAGE, len(x["tokens"]) // CHUNK * CHUNK // PAGE)
             for x in lines]  # the keys its look-ups and its publishing ask for
    assert len(calls) == sum(asked)
