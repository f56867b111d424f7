"""pdgpu serve on the hybrid families (issue 33, contract v3): Qwen3.5 (gated DeltaNet: its
state crosses in state spans) and Gemma 3 (sliding windows: only the window's K/V crosses).
Served tokens equal `pdgpu generate`'s and transformers' greedy tokens (where its top-2
margin is clear), traces are legal under v3 with the contract's bytes, `--verify` covers
state bytes, and faults on state and window-cut spans are fenced and retried."""

from __future__ import annotations

import functools
import json
import os
import signal

import pytest
import torch
from hybrid_helpers import kv_bytes
from serve_helpers import (
    drawn_prompts,
    events_of,
    reference,
    serve,
    trace_ok,
    watch_decoder,
)
from test_pdgpu_hybrid import GEMMA3, QWEN35, _randomize
from test_pdgpu_transformers_parity import agree_while_clear, hf_greedy
from wait_helpers import in_thread, wait_for

from pdgpu.checkpoint import inspect_checkpoint
from pdgpu.handoff import handoff_geometry, kv_groups
from pdgpu.serve.digest import row_digests, state_rows
from pdgpu.serve.ledger import Ledger
from pdgpu.serve.tracelog import TraceLog
from pdgpu.state_pool import StateShape
from pdref import events as ev
from pdref.geometry import Geometry
from pdref.kinds import LayerKind
from pdref.trace import parse_lines

transformers = pytest.importorskip("transformers")

CHUNK = 32


def save_sensitive(folder, family: str) -> str:
    """A random checkpoint of `family` saved by transformers whose tokens depend on the
    context: Gemma 3's embedding scaled down (at its init, sqrt(hidden) times the embedding
    outweighs attention, and every step repeats one token whatever the window holds)."""
    torch.manual_seed(0)
    if family == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**QWEN35))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3))
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(0.1)
    _randomize(model)
    model.save_pretrained(folder)
    return str(folder)


@functools.cache
def _checkpoint(root: str, family: str) -> str:
    from pathlib import Path
    return save_sensitive(Path(root) / family, family)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> checkpoint folder (made once per module)."""
    root = str(tmp_path_factory.mktemp("hybrids"))
    return lambda family: _checkpoint(root, family)


@functools.cache
def _hf(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                             dtype=torch.float32).eval()


def _assert_tokens(folder: str, prompts: list[dict], results: list[dict], prefix: int) -> int:
    """Each request ok with generate's tokens and transformers' where its margin is clear;
    how many tokens transformers' margins let us compare."""
    compared = 0
    for line, result in zip(prompts, results, strict=True):
        assert result["status"] == "ok", result
        want = reference(folder, line["tokens"], line["output_tokens"], CHUNK, prefix)
        assert result["output"] == want, (line["req"], result["output"], want)
        theirs, margins = hf_greedy(_hf(folder), line["tokens"], line["output_tokens"])
        compared += agree_while_clear(result["output"], theirs, margins)
    return compared


def _assert_v3_bytes(trace: list[bytes]) -> dict:
    """Every issue's bytes are the contract's (tests/hybrid_helpers.py: a sliding layer's
    window only, a state span its layers' state); every admitted life's state landed. Totals
    by kind."""
    geo = next(parse_lines(trace))[1].geometry
    reserves = {e["req"]: e for e in events_of(trace, "reserve")}
    totals = {"kv": 0, "state": 0}
    for e in events_of(trace, "issue"):
        r = reserves[e["req"]]
        if e.get("state"):
            want = sum(geo.kinds[la].state_bytes for la in range(*e["layers"]))
            assert e["tokens"] == [r["prompt"], r["prompt"]]
            totals["state"] += e["bytes"]
        else:
            want = kv_bytes(geo, e["layers"], e["tokens"], r["prompt"], r["prefix"])
            totals["kv"] += e["bytes"]
        assert e["bytes"] == want, e
    return totals


def _serve(tmp_path, folder: str, lengths, prefix: int, out: int, *args: str):
    prompts = drawn_prompts(tmp_path / "p.jsonl", len(lengths), list(lengths), 256, prefix, out)
    code, results, trace = serve(
        tmp_path, "--model", folder, "--producers", "2", "--prompts", str(tmp_path / "p.jsonl"),
        "--prefix", str(prefix), "--chunk", str(CHUNK), "--verify", *args)
    assert code == 0
    trace_ok(trace)
    return prompts, results, trace


@pytest.mark.parametrize(("family", "mode", "lane", "prefix"),
                         [("qwen3_5", "layer", "shm", 16), ("gemma3", "chunk", "shm", 0),
                          ("gemma3", "whole", "gloo", 16)])
def test_served_tokens_equal_generate_and_transformers(tmp_path, models, family, mode, lane,
                                                       prefix):
    """Two producers, prompts 7..300 in chunks of 32, every KV lane: tokens equal generate's
    and transformers'; the trace is legal v3 with the contract's bytes (no prefix cache: v4
    with it); a Qwen3.5 life's state crosses once per run of linear layers, a Gemma 3
    sliding layer's window only."""
    folder = models(family)
    prompts, results, trace = _serve(tmp_path, folder, (7 + prefix, 150, 300), prefix, 6,
                                     "--mode", mode, "--kv-lane", lane, "--no-prefix-cache")
    assert _assert_tokens(folder, prompts, results, prefix) >= 6
    header = json.loads(trace[0])
    assert header["version"] == 3 and header["transport"] == lane
    totals = _assert_v3_bytes(trace)
    states = [e for e in events_of(trace, "issue") if e.get("state")]
    geo = handoff_geometry(inspect_checkpoint(folder), 16)
    if family == "qwen3_5":
        runs = len(geo.layout.linear) if mode != "layer" else 3
        assert len(states) == runs * len(prompts) and totals["state"] > 0
    else:  # every sliding layer's full suffix would be more than what crossed
        assert not states
        full = sum(geo.bytes_per_token_layer * geo.layers * (len(p["tokens"]) - prefix)
                   for p in prompts)
        assert totals["kv"] < full / 2


def test_a_prompt_that_is_all_prefix_still_hands_off_its_state(tmp_path, models):
    """A Qwen3.5 prompt no longer than the shared prefix computes nothing of its own: its
    state span (the prefix's state) still crosses, in chunk mode as in whole mode, and it
    decodes generate's tokens."""
    folder = models("qwen3_5")
    prompts, results, trace = _serve(tmp_path, folder, (16, 40), 16, 4, "--mode", "chunk")
    _assert_tokens(folder, prompts, results, 16)
    states = {e["req"]: e for e in events_of(trace, "issue") if e.get("state")}
    assert states["q0"]["tokens"] == [16, 16] and set(states) == {"q0", "q1"}


def test_span_groups_carry_the_contracts_bytes():
    """handoff.kv_groups of a span over any layers of a hybrid carry exactly the bytes the
    contract counts (pdref's span_bytes), in K/V layers that skip the linear ones."""
    kinds = (LayerKind("linear", None, 8), LayerKind("sliding", 5), LayerKind("sliding", 5),
             LayerKind("full"), LayerKind("linear", None, 8), LayerKind("sliding", 5))
    geo = Geometry(6, 1, 2, 1, 4, True, kinds)
    for layers in [(0, 6), (1, 3), (2, 6), (4, 5), (3, 4)]:
        for tokens, prompt, prefix in [((0, 8), 20, 0), ((16, 20), 20, 0), ((4, 30), 30, 4),
                                       ((8, 12), 13, 8)]:
            groups = kv_groups(geo, layers, tokens, prompt, prefix)
            cells = sum((g.layers[1] - g.layers[0]) * (g.tokens[1] - g.tokens[0])
                        for g in groups)
            assert cells * geo.bytes_per_token_layer == \
                geo.span_bytes(layers, tokens, prompt, prefix)
            assert all(0 <= g.layers[0] < g.layers[1] <= 4 for g in groups)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_served_tokens_sweep_over_prompt_lengths(tmp_path, models, family, mode):
    """Prompts 7..300 (around chunk and page edges, past the window and a DeltaNet block),
    chunk 32, two producers, every mode: generate's and transformers' tokens."""
    folder = models(family)
    lengths = (7, 31, 32, 33, 64, 65, 129, 200, 300)
    prompts, results, trace = _serve(tmp_path, folder, lengths, 0, 8, "--mode", mode)
    _assert_tokens(folder, prompts, results, 0)
    _assert_v3_bytes(trace)


# -- the decoder's ledger on a hybrid, without processes ----------------------------------------

SHAPE = StateShape(1, (4, 3), (2, 2, 2), torch.float32)  # one linear layer: 48 + 32 bytes
KINDS = (LayerKind("linear", None, SHAPE.nbytes), LayerKind("sliding", 5), LayerKind("full"))
GEO3 = Geometry(3, 2, 4, 4, 4, True, KINDS)


@pytest.fixture
def ledger(tmp_path):
    """A v3 ledger over a 4-page pool (its audit stopped at teardown)."""
    header = ev.Header("test", "chunk", GEO3, 4, 4)
    made = Ledger(header, "cpu", torch.float32, TraceLog(header, tmp_path / "t.jsonl"),
                  state=SHAPE)
    yield made
    made.stop()


def _kv_span(ledger, tokens, prompt: int):
    """Issue and land the KV span of every layer over `tokens`; its groups' kv."""
    ledger.computed("r", (0, 3), tokens)
    span = ledger.issue("r", (0, 3), tokens, GEO3.span_bytes((0, 3), tokens, prompt, 0))
    payload = []
    for (l0, l1), (a, b) in kv_groups(GEO3, (0, 3), tokens, prompt, 0):
        kv = torch.randn(l1 - l0, 2, b - a, 2, 4)  # [n, 2, nt, KVH, D]
        payload += [kv, row_digests(kv)]
    assert ledger.land("r", span, *payload) is None
    return payload[0::2]


def _state_payload():
    conv, rec = torch.randn(1, 4, 3), torch.randn(1, 2, 2, 2)
    return conv, rec, [conv, row_digests(state_rows(conv)), rec, row_digests(state_rows(rec))]


def test_a_state_span_lands_and_admission_hands_the_state_to_decoding(ledger):
    """The reserve names the producer's free state slot; the sliding layer's window and the
    full layer's tokens land where admit reads them; admission waits for the state
    (STATE-3), then the state slot admission names holds exactly the bytes that crossed."""
    assert ledger.reserve("r", 12, 0, "p1") == 0
    first = _kv_span(ledger, (0, 8), 12)  # the window [8, 12) of the sliding layer: not here
    last = _kv_span(ledger, (8, 12), 12)
    ledger.produced("r", 3)
    assert not ledger.can_admit("r")  # the linear layer's state has not landed
    span = ledger.issue("r", (0, 1), (12, 12), SHAPE.nbytes, True)
    conv, rec, payload = _state_payload()
    assert ledger.land("r", span, *payload) is None
    assert ledger.can_admit("r")
    ledger.reuse("r", (0, 12))
    admitted = ledger.admit("r")
    context = admitted.kv.index_select(2, admitted.slots)  # [Lkv, 2, 12, KVH, D]
    assert len(first) == 1 and torch.equal(context[1, :, :8], first[0][0])  # full: every token
    assert torch.equal(context[:, :, 8:], last[0])  # both layers over the window
    got = ledger.kv_landing.states.read(admitted.state_slot)
    assert torch.equal(got[0], conv) and torch.equal(got[1], rec)
    ledger.kv_landing.states.give_back(admitted.state_slot)  # the decode cache's to give
    ledger.release("r")
    ledger.close()


def test_verify_catches_a_state_altered_in_transit(ledger):
    """One bit of the recurrent state changed after its digests were taken: fail + fence,
    never admitted; the abort gives the landing slot and every page back."""
    ledger.reserve("r", 12, 0, "p1")
    _kv_span(ledger, (0, 12), 12)
    ledger.produced("r", 3)
    span = ledger.issue("r", (0, 1), (12, 12), SHAPE.nbytes, True)
    _, rec, payload = _state_payload()
    rec.view(torch.int32).view(-1)[5] ^= 1
    assert ledger.land("r", span, *payload) == \
        "checksum mismatch in the recurrent state of linear layer 0"
    assert [e.kind for e in list(ledger.recent)[-2:]] == ["fail", "fence"]
    assert not ledger.can_admit("r")
    ledger.reuse("r", (0, 12))
    ledger.abort("r", "copy failed")
    assert ledger.used_pages == 0 and ledger.kv_landing.states.free == [0]
    ledger.close()


# -- faults on state spans and window-cut spans --------------------------------------------------

def _faulty(tmp_path, capsys, folder: str, count: int, *args: str, lengths=(40, 64, 33, 50),
            prefix: int = 0):
    """Serve `count` drawn prompts under faults; after the checks every faulty run passes
    (legal trace, nothing leaked, ok requests with generate's tokens, failed ones after
    every attempt, every failed span fenced): (results, trace, summary)."""
    prompts = drawn_prompts(tmp_path / "p.jsonl", count, list(lengths), 256, prefix, 3)
    code, results, trace = serve(
        tmp_path, "--model", folder, "--prompts", str(tmp_path / "p.jsonl"), "--chunk",
        str(CHUNK), "--json", "--verify", "--producers", "2", "--concurrency", "4",
        "--prefix", str(prefix), "--max-attempts", "4", *args)
    summary = json.loads(capsys.readouterr().out)
    trace_ok(trace)
    assert summary["leaked_pages"] == 0 and len(results) == count
    for line, r in zip(prompts, results, strict=True):
        assert r["status"] in ("ok", "failed"), r
        if r["status"] == "ok":
            assert r["output"] == _reference(folder, tuple(line["tokens"]), prefix), r["req"]
        else:
            assert r["attempts"] == 4 and r["reason"], r
    assert code == (1 if summary["failed"] else 0)
    fenced = {e["span"] for e in events_of(trace, "fence")}
    assert {e["span"] for e in events_of(trace, "fail")} <= fenced
    return results, trace, summary


@functools.cache
def _reference(folder: str, tokens: tuple[int, ...], prefix: int) -> list[int]:
    return reference(folder, tokens, 3, CHUNK, prefix)


def _failed_issues(trace) -> list[dict]:
    failed = {e["span"] for e in events_of(trace, "fail")}
    return [e for e in events_of(trace, "issue") if e["span"] in failed]


def test_state_spans_that_fail_stall_or_are_corrupted_are_fenced_and_retried(tmp_path, capsys,
                                                                             models):
    """Qwen3.5 in layer mode (a state span per linear layer) under every fault and a killed
    and restarted producer: failed, stalled and corrupted state spans are fenced like K/V
    spans, their lives retried."""
    results, trace, summary = _faulty(
        tmp_path, capsys, models("qwen3_5"), 24, "--mode", "layer", "--fail-rate", "0.1",
        "--stall-rate", "0.05", "--span-timeout", "0.5", "--corrupt-rate", "0.1",
        "--kill-producer", "0@0.3", "--restart-producers", "--link-gbps", "0.0005",
        lengths=(17, 18, 19, 20), prefix=16)
    states = [e for e in _failed_issues(trace) if e.get("state")]
    errors = [next(f["error"] for f in events_of(trace, "fail") if f["span"] == e["span"])
              for e in states]
    for words in ("checksum mismatch in the", "copy failed (injected)", "not landed within"):
        assert any(words in error for error in errors), words
    assert summary["producer_deaths"] == 1 and summary["ok"] >= 18


@pytest.fixture
def started(monkeypatch):
    """The next in-process run's Decoder, once its serving loop starts."""
    return watch_decoder(monkeypatch)


def _state_in_flight(decoder, rank: int) -> int | None:
    """A state span producer `rank` issued whose bytes have not come (pdref span id)."""
    for life in list(decoder.lives.values()):
        if life.producer != rank:
            continue
        for span in list(life.spans.values()):
            found = None if span is None else decoder.ledger.live.monitor.landing(life.req, span)
            if found is not None and found.slot is not None:
                return span
    return None


def test_a_producer_killed_mid_state_is_survived(tmp_path, capsys, models, started):
    """SIGKILL of p1 while one of its state spans is on the (slow, paced) link: that span
    fails as its producer is lost and is fenced, its life is retried on p2, and every
    request ends ok with generate's tokens."""
    seen = {}

    def kill_mid_state():
        if not started["event"].wait(120):
            return
        decoder = started["decoder"]
        wait_for(lambda: _state_in_flight(decoder, 1) is not None, polls=60000)
        seen["span"] = _state_in_flight(decoder, 1)
        if seen["span"] is not None:
            os.kill(decoder.members.processes.procs[1].pid, signal.SIGKILL)

    finish = in_thread(kill_mid_state)
    results, trace, summary = _faulty(tmp_path, capsys, models("qwen3_5"), 4,
                                      "--link-gbps", "0.00002", lengths=(20, 40))
    finish()
    assert seen.get("span") is not None, "no state span of p1 was seen in flight"
    fail = [f for f in events_of(trace, "fail") if f["span"] == seen["span"]]
    assert [f["error"] for f in fail] == ["producer p1 lost"]
    assert summary["producer_deaths"] == 1 and summary["ok"] == 4


def test_window_cut_spans_under_faults_and_a_killed_producer(tmp_path, capsys, models):
    """Gemma 3 in chunk mode under every fault and a killed producer: failed window-cut
    spans are fenced and retried; every request ends ok with generate's tokens."""
    results, trace, summary = _faulty(
        tmp_path, capsys, models("gemma3"), 16, "--fail-rate", "0.1", "--corrupt-rate", "0.1",
        "--kill-producer", "0@0.3", "--link-gbps", "0.0005")
    geo = next(parse_lines(trace))[1].geometry
    assert any(e["bytes"] < geo.region_bytes(e["layers"], e["tokens"])  # the window cut
               for e in _failed_issues(trace))
    assert summary["producer_deaths"] == 1 and summary["ok"] >= 12


def test_a_qwen35_whose_first_layer_is_full_loads(tmp_path):
    """A Qwen3.5 checkpoint with layer 0 full attention (its q_proj holds queries and gates)
    is read with the head_dim its config names (the dense twin of bench/hybrid_serve_bytes)."""
    config = transformers.Qwen3_5TextConfig(**QWEN35)
    config.layer_types = ["full_attention", *config.layer_types[1:]]
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(tmp_path)
    spec = inspect_checkpoint(str(tmp_path))
    assert spec.head_dim == 32 and handoff_geometry(spec, 16).kinds[0].kind == "full"


@pytest.mark.slow
def test_the_served_bytes_bench_counts_each_kind(capsys):
    """bench/hybrid_serve_bytes.py: from served traces, a Qwen3.5 hands off its full layers'
    K/V and its linear layers' state, a Gemma 3 its sliding layers' window only, each less
    than its dense twin."""
    import runpy
    from pathlib import Path
    bench = runpy.run_path(str(Path(__file__).parent.parent / "bench" / "hybrid_serve_bytes.py"))
    assert bench["main"](["--prompt", "320", "--chunk", "64", "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
    per_token_layer = 2 * 2 * 32 * 4
    assert rows["qwen3_5 dense twin"]["kv_bytes"] == 8 * 320 * per_token_layer
    assert rows["qwen3_5"]["kv_bytes"] == 2 * 320 * per_token_layer
    assert rows["qwen3_5"]["state_bytes"] == 6 * 5632
    # window 256 of a 320-token prompt: tokens [64, 320) (page 16)
    assert rows["gemma3"]["kv_bytes"] == (2 * 320 + 10 * 256) * per_token_layer
    assert rows["gemma3 dense twin"]["ratio"] == 1.0 and rows["gemma3"]["ratio"] < 0.9


@pytest.mark.parametrize(("family", "mode"), [("gemma3", "chunk"), ("gemma3", "layer"),
                                            ("qwen3_5", "chunk"), ("qwen3_5", "whole")])
def test_hybrids_with_the_producer_prefix_cache_keep_tokens(tmp_path, models, family, mode):
    """--prefix-cache on Gemma 3 (sliding windows) and Qwen3.5 (linear layers: a hit loads
    the state kept at its end): prompts sharing 96 tokens, one repeated, skip their cached
    chunks; tokens equal generate's without the cache; a legal version 4 trace whose spans
    carry the contract's bytes (windows, states)."""
    folder = models(family)
    prompts = drawn_prompts(tmp_path / "p.jsonl", 3, [150, 200, 110], 256, 96, 5)
    prompts.append({**prompts[1], "req": "again"})
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in prompts))
    code, results, trace = serve(
        tmp_path, "--model", folder, "--prompts", str(tmp_path / "p.jsonl"), "--chunk",
        str(CHUNK), "--mode", mode, "--prefix-cache", "--concurrency", "1", "--verify")
    assert code == 0 and json.loads(trace[0])["version"] == 4
    trace_ok(trace)
    for line, result in zip(prompts, results, strict=True):
        want = reference(folder, line["tokens"], line["output_tokens"], CHUNK, 0)
        assert result["output"] == want, line["req"]
    hits = {e["req"]: e["tokens"][1] for e in events_of(trace, "computed") if e.get("hit")}
    assert hits["again"] >= 192 and len(hits) == 3
    _assert_v3_bytes(trace)
