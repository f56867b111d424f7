"""The producer's automatic prefix cache (`--prefix-cache`, contract v4): hits skip compute,
tokens stay those of `generate` without the cache, traces are legal and leave no page held."""

from __future__ import annotations

import functools
import hashlib
import json
from types import SimpleNamespace

import pytest
from serve_helpers import (
    drawn_prompts,
    events_of,
    reference,
    serve,
    trace_ok,
    watch_decoder,
    write_sensitive_checkpoint,
)
from test_pdgpu_serve_bugs import Recording

from pdgpu import prefix_index
from pdgpu.cli import main
from pdgpu.generate import generate, generate_cached
from pdgpu.model import build_model
from pdgpu.serve.config import ServeConfig
from pdgpu.serve.models import load_served_model
from pdgpu.serve.producer import Producer
from pdgpu.serve.transport import Message
from pdgpu.source_prefix import skip_tokens
from pdref.events import Mode
from pdref.models import load_model
from pdref.plan import plan_spans

CHUNK, PAGE = 16, 8
SHARED = 48  # the leading tokens every drawn prompt shares


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_sensitive_checkpoint(tmp_path_factory.mktemp("ckpt") / "sensitive"))


@functools.cache
def _reference(model: str, tokens: tuple[int, ...], out: int) -> list[int]:
    return reference(model, tokens, out, CHUNK, 0)


def _prompts(path, count: int, out: int) -> list[dict]:
    """Prompts sharing SHARED leading tokens, the last one repeating the first."""
    lines = drawn_prompts(path, count - 1, [70, 90, 50, 81], 256, SHARED, out)
    lines.append({**lines[0], "req": f"q{count - 1}"})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def _computed_tokens(trace: list[bytes]) -> int:
    """Prompt tokens the producers computed (a hit is not computed; layer mode: layer 0's)."""
    return sum(e["tokens"][1] - e["tokens"][0] for e in events_of(trace, "computed")
               if e.get("hit") is None and e["layers"][0] == 0)


def test_a_hit_skips_whole_chunks_and_leaves_a_token_to_compute():
    """skip_tokens: whole pages and whole chunks only, never the prompt's last token."""
    assert skip_tokens(6, 8, 16, 100) == 48
    assert skip_tokens(5, 8, 16, 100) == 32  # 40 tokens cached: the chunk [32, 48) is computed
    assert skip_tokens(4, 8, 16, 32) == 16  # a whole cached prompt still computes its last chunk
    assert skip_tokens(2, 16, 24, 200) == 0  # 32 tokens: no whole chunk and page (48)...
    assert skip_tokens(3, 16, 24, 49) == 48  # ...until the pages reach one
    assert skip_tokens(3, 16, 24, 48) == 0  # and the prompt goes past it


def test_generate_through_the_cache_gives_the_same_tokens_and_computes_less(checkpoint,
                                                                           tmp_path):
    """Prompts sharing prefixes, some repeated, a budget that forces evictions or one that
    keeps all: each prompt's tokens equal `generate` without the cache."""
    lines = _prompts(tmp_path / "p.jsonl", 6, 5)
    prompts = [x["tokens"] for x in lines] + [lines[1]["tokens"][:SHARED + 8]]
    model = load_served_model(checkpoint, 0, None, "cpu")
    want = [generate(model, p, 5, CHUNK, 0, PAGE) for p in prompts]
    for budget in (4, 64):
        got, computed = generate_cached(model, prompts, [5] * len(prompts), CHUNK, PAGE, budget)
        assert got == want, budget
        assert computed < sum(map(len, prompts)) - (len(prompts) - 2) * SHARED // 2, budget


@pytest.mark.parametrize(("mode", "producers", "extra"),
                         [("chunk", 1, ()), ("whole", 2, ("--prefix-cache",)),
                          ("layer", 1, ("--prefix-cache-pages", "8"))])
def test_served_hits_skip_compute_and_keep_tokens(tmp_path, capsys, monkeypatch, checkpoint,
                                                  mode, producers, extra):
    """Shared prefixes served with the cache (by default, asked for, or its budget given):
    fewer tokens computed than the prompts hold,
    every token equal to generate's, a legal version 4 trace (a small budget evicts), no
    page leaked, and each request's hit where the decoder sees it (`producer_hit`)."""
    box = watch_decoder(monkeypatch)
    lines = _prompts(tmp_path / "p.jsonl", 7, 4)
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--mode", mode, "--prompts", str(tmp_path / "p.jsonl"),
        "--chunk", str(CHUNK), "--page-tokens", str(PAGE), "--concurrency", "2",
        "--producers", str(producers), "--json", *extra)
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and json.loads(trace[0])["version"] == 4
    trace_ok(trace)
    for line, r in zip(lines, results, strict=True):
        assert r["output"] == _reference(checkpoint, tuple(line["tokens"]), 4), r["req"]
    hits = [e for e in events_of(trace, "computed") if e.get("hit")]
    assert hits and events_of(trace, "cache")
    assert _computed_tokens(trace) == sum(len(x["tokens"]) for x in lines) - \
        sum(e["tokens"][1] for e in hits)
    if "--prefix-cache-pages" in extra:
        assert events_of(trace, "evict")
    seen = {t.req: t.producer_hit for t in box["decoder"].tracked.values()}
    assert seen == {x["req"]: next((e["tokens"][1] for e in hits if e["req"] == x["req"]), 0)
                    for x in lines}
    assert summary["leaked_pages"] == 0


def test_a_hybrid_under_a_tight_budget_counting_its_snapshots_keeps_tokens(tmp_path, capsys):
    """Qwen3.5 served with a producer budget of 12 pages, a state snapshot worth 5 of them
    (its measured holdings: tests/test_pdgpu_source_prefix.py): hits still end at a kept
    snapshot, every token equals generate's, a legal version 4 trace, no page leaked."""
    lines = _prompts(tmp_path / "p.jsonl", 6, 3)
    code, results, trace = serve(
        tmp_path, "--model", "tiny-qwen3.5", "--prompts", str(tmp_path / "p.jsonl"), "--chunk",
        str(CHUNK), "--page-tokens", str(PAGE), "--prefix-cache", "--prefix-cache-pages",
        "12", "--concurrency", "1", "--json")
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["leaked_pages"] == 0
    trace_ok(trace)
    for line, r in zip(lines, results, strict=True):
        assert r["output"] == _reference("tiny-qwen3.5", tuple(line["tokens"]), 3), r["req"]
    hits = [e["tokens"][1] for e in events_of(trace, "computed") if e.get("hit")]
    assert hits and all(h == 16 for h in hits)  # 16: the one snapshot the budget keeps


def test_faults_with_the_cache_keep_tokens_and_traces_legal(tmp_path, capsys, checkpoint):
    """Failed, corrupted and cancelled spans and a killed, restarted producer with the cache
    on (the default, --verify's too): ok requests' tokens unchanged, the trace legal, no page
    leaked."""
    lines = _prompts(tmp_path / "p.jsonl", 24, 3)
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--prompts", str(tmp_path / "p.jsonl"), "--chunk",
        str(CHUNK), "--page-tokens", str(PAGE), "--prefix-cache-pages", "12",
        "--producers", "2", "--concurrency", "4", "--fail-rate", "0.1", "--corrupt-rate", "0.1",
        "--cancel-rate", "0.1", "--kill-producer", "0@0.3", "--restart-producers",
        "--link-gbps", "0.001", "--json")
    summary = json.loads(capsys.readouterr().out)
    trace_ok(trace)
    assert summary["leaked_pages"] == 0
    assert events_of(trace, "fail") and events_of(trace, "evict") and summary["cancelled"]
    assert summary["producer_restarts"] == summary["producer_deaths"] == 1
    hits = {e["req"] for e in events_of(trace, "computed") if e.get("hit")}
    assert len(hits) > len(lines) // 2
    for line, r in zip(lines, results, strict=True):
        if r["status"] == "ok":
            assert r["output"] == _reference(checkpoint, tuple(line["tokens"]), 3), r["req"]
    assert code == (1 if summary["failed"] else 0)


@pytest.mark.parametrize(("args", "word"), [
    (["--no-prefix-cache", "--prefix-cache-pages", "4"],
     "prefix-cache-pages: needs the prefix cache (not with --no-prefix-cache)"),
    (["--prefix-cache-pages", "4", "--prefix", "16"], "prefix-cache: refused with --prefix"),
    (["--prefix-cache", "--prefix", "16"], "prefix-cache: refused with --prefix"),
    (["--prefix-cache", "--model", "tiny-qwen3.5", "--mode", "layer"],
     "prefix-cache: refused in layer mode for a model with linear layers"),
    (["--prefix-cache", "--prefix-cache-pages", "0"], "--prefix-cache-pages"),
])
def test_prefix_cache_options_that_make_no_sense_are_refused(tmp_path, capsys, args, word):
    """One line naming the option, exit 2, nothing started."""
    assert main(["serve", "--requests", "2", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert word in err and err.count("\n") == 1


def test_generate_prompts_prints_the_same_tokens_with_the_cache(tmp_path, capsys, checkpoint):
    """`pdgpu generate --prompts F` (the cache on by default): the tokens of the run with
    `--no-prefix-cache`, fewer prompt tokens computed; `--prefix-cache` with one prompt is
    refused (exit 2)."""
    _prompts(tmp_path / "p.jsonl", 4, 3)
    runs = []
    for extra in (["--no-prefix-cache"], []):
        assert main(["generate", "--model", checkpoint, "--prompts", str(tmp_path / "p.jsonl"),
                     "--chunk", str(CHUNK), "--page-tokens", str(PAGE), "--json", *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    off, on = runs
    assert on["outputs"] == off["outputs"] and off["computed_tokens"] == off["prompt_tokens"]
    assert on["computed_tokens"] < off["computed_tokens"]
    assert on["prefix_cache"] and off["prefix_cache_off"] == "--no-prefix-cache"
    assert main(["generate", "--tokens", "1,2,3", "--prefix-cache"]) == 2
    assert "prefix-cache: needs --prompts" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
@pytest.mark.parametrize(("prompt", "start", "prefix"),
                         [(70, 48, 0), (70, 48, 16), (70, 16, 48), (33, 32, 32), (40, 0, 8)])
def test_a_plan_with_a_hit_computes_from_the_hit_and_sends_from_the_prefix(mode, prompt, start,
                                                                            prefix):
    """plan_with_hit: chunks from the hit's end at multiples of the chunk, and every layer's
    [prefix, prompt) sent exactly once (the hit's part at once in chunk mode), whichever of
    the decoder's prefix and the producer's hit is longer."""
    from pdgpu.serve.producer_cache import plan_with_hit
    from pdref.events import Mode
    from pdref.geometry import Geometry
    geometry = Geometry(layers=3, kv_heads=1, head_dim=2, dtype_bytes=4, page_tokens=PAGE)
    plan = plan_with_hit(Mode(mode), geometry, prompt, start, prefix, CHUNK)
    if mode != "layer":
        assert plan.steps[0][0] == start and all(a % CHUNK == 0 for a, _ in plan.steps)
        assert plan.steps[-1][1] == prompt
    sent = [r for r in plan.upfront + [r for rs in plan.ready for r in rs] + plan.after
            if r.tokens[0] < r.tokens[1]]
    for layer in range(3):
        rows = sorted(r.tokens for r in sent if r.layers[0] <= layer < r.layers[1])
        assert rows[0][0] == prefix and rows[-1][1] == prompt
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))


def test_a_prefill_waiting_for_room_is_hashed_once_however_many_turns_it_waits(monkeypatch):
    """A producer whose pool fits one life: the second waits 30 turns (its prompt looked up
    on each), yet each page of each prompt is hashed once (its kept key chain), every
    look-up, the open and the caching of its pages included."""
    calls = []
    real = hashlib.blake2b
    monkeypatch.setattr(prefix_index, "hashlib", SimpleNamespace(
        blake2b=lambda data, **kw: calls.append(data) or real(data, **kw)))
    config = ServeConfig("tiny", "whole", chunk=CHUNK, max_pending=64, page_tokens=PAGE,
                         source_pages=12, prefix_cache_pages=12)
    transport = Recording()
    producer = Producer(transport, config, build_model(load_model("tiny"), seed=0), "p1")
    first, second = list(range(1, 81)), list(range(101, 191))  # 10 and 12 pages
    try:
        producer._handle(Message(0, "prefill", {"handle": "a", "tokens": first}))
        producer._handle(Message(0, "prefill", {"handle": "b", "tokens": second}))
        while producer.active is not None or len(producer.waiting) == 2:
            producer._step()
        for _ in range(30):
            producer._step()
        assert producer.active is None and len(producer.waiting) == 1  # no room: it waits
        transport.spans(len(plan_spans(Mode.WHOLE, producer.geometry, len(first), 0, CHUNK)))
        producer._handle(Message(0, "cached", {"handle": "a", "recorded": True}))
        producer._handle(Message(0, "reuse", {"handle": "a"}))  # a's pages idle: evicted
        while producer.active is not None or producer.waiting:
            producer._step()
    finally:
        producer.close()
    # pages asked for: the look-ups' (prompt - 1 tokens), the caching's (whole chunks)
    assert len(calls) == max(79 // PAGE, 80 // PAGE) + max(89 // PAGE, 80 // PAGE)
    ops = transport.ops()
    assert ops.count("cache") == 2 and ops.index("evict") > ops.index("produced")  # b's room
