"""pdgpu serve: served tokens equal the single-process reference in every mode, with prefix
reuse and 1..3 producers; verify turns broken copies into `fail`; pool backpressure."""

from __future__ import annotations

import json
import re

import pytest
import torch
from serve_helpers import (
    drawn_prompts,
    events_of,
    reference,
    serve,
    trace_ok,
    write_sensitive_checkpoint,
)

from pdgpu.serve.config import Capabilities, producer_capabilities, refusal
from pdgpu.serve.digest import first_mismatch, row_digests
from pdref.events import Mode
from pdref.models import load_model

CHUNK = 16
PREFIX = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_sensitive_checkpoint(tmp_path_factory.mktemp("ckpt") / "sensitive"))


def _assert_parity(model: str, prompts: list[dict], results: list[dict], prefix: int) -> None:
    for line, result in zip(prompts, results, strict=True):
        want = reference(model, line["tokens"], line["output_tokens"], CHUNK, prefix)
        assert result["status"] == "ok", result
        assert result["output"] == want, (line["req"], result["output"], want)


@pytest.mark.parametrize(("mode", "producers", "lane"),
                         [("whole", 1, "gloo"), ("chunk", 2, "shm"), ("layer", 3, "shm")])
def test_served_tokens_equal_generate_in_every_mode(tmp_path, checkpoint, mode, producers,
                                                    lane):
    """An HF checkpoint, a shared prefix, N producers, KV over gloo or shared memory: every
    request's tokens equal generate."""
    prompts = drawn_prompts(tmp_path / "p.jsonl", 4, [37, 64, 50, 81], 256, PREFIX, 6)
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--mode", mode, "--producers", str(producers),
        "--prompts", str(tmp_path / "p.jsonl"), "--prefix", str(PREFIX), "--chunk", str(CHUNK),
        "--kv-lane", lane)
    assert code == 0 and json.loads(trace[0])["transport"] == lane
    _assert_parity(checkpoint, prompts, results, PREFIX)
    trace_ok(trace)
    used = {e["producer"] for e in events_of(trace, "reserve")}
    assert used == {f"p{r}" for r in range(1, producers + 1)}  # least-loaded spreads the work
    assert len(events_of(trace, "land")) >= 4 and not events_of(trace, "fail")
    _assert_decode_stages(trace, prompts, results)


def _assert_decode_stages(trace, prompts, results) -> None:
    """Each decode stage's batch and KV tokens add up to the rows the requests decoded: a
    request of P prompt tokens and N outputs decodes N-1 rows over P, P+1, ... KV tokens."""
    decodes = [e for e in events_of(trace, "stage") if e["name"] == "decode"]
    rows = [(len(p["tokens"]), len(r["output"])) for p, r in zip(prompts, results, strict=True)]
    assert sum(d["batch"] for d in decodes) == sum(n - 1 for _, n in rows)
    want_kv = sum((n - 1) * p + (n - 1) * (n - 2) // 2 for p, n in rows)
    assert sum(d["kv_tokens"] for d in decodes) == want_kv


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_presets_serve_like_generate(tmp_path, preset):
    """The built-in presets (seeded weights, drawn prompts) match generate too."""
    vocab = load_model(preset).vocab
    prompts = drawn_prompts(tmp_path / "p.jsonl", 3, [40, 57, 33], vocab, PREFIX, 4, seed=1)
    code, results, trace = serve(
        tmp_path, "--model", preset, "--producers", "2", "--prompts", str(tmp_path / "p.jsonl"),
        "--prefix", str(PREFIX), "--chunk", str(CHUNK), "--verify")
    assert code == 0
    _assert_parity(preset, prompts, results, PREFIX)
    trace_ok(trace)
    _assert_clocks_agree(trace)


def _assert_clocks_agree(trace) -> None:
    """Each producer's stages sit on the decoder's clock (pdgpu/serve/clock.py): a first
    token (the decoder's event) comes after its LM head ended (the producer's stage), each
    `computed` after a compute stage of its request ended, within a few milliseconds."""
    stages = events_of(trace, "stage")
    head_end = {e["req"]: e["end"] for e in stages if e["name"] == "head"}
    for e in events_of(trace, "produced"):
        assert e["t"] >= head_end[e["req"]] - 0.003, (e, head_end[e["req"]])
    computes = [e for e in stages if e["name"] == "compute"]
    for e in events_of(trace, "computed"):
        assert any(s["req"] == e["req"] and s["end"] <= e["t"] + 0.003 for s in computes), e


def test_small_pool_backpressure_keeps_arrival_order(tmp_path, checkpoint, capsys):
    """A pool that holds one request: reserves wait for pages, in arrival order, none lost;
    the summary and result lines carry specs/contract.md's names."""
    prompts = drawn_prompts(tmp_path / "p.jsonl", 4, [80, 30, 64, 20], 256, 0, 3, seed=2)
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--prompts", str(tmp_path / "p.jsonl"),
        "--chunk", str(CHUNK), "--pool-pages", "5", "--producers", "2", "--verify", "--json")
    assert code == 0
    _assert_parity(checkpoint, prompts, results, 0)
    trace_ok(trace)
    assert [e["req"] for e in events_of(trace, "reserve")] == ["q0", "q1", "q2", "q3"]
    held, peak = {}, 0
    for e in map(json.loads, trace[1:]):
        if e["kind"] == "reserve":
            held[e["req"]] = len(e["pages"])
        elif e["kind"] in ("release", "abort"):
            del held[e["req"]]
        peak = max(peak, sum(held.values()))
    assert peak == 5  # never overcommitted; q0 (80 tokens, 5 pages) filled it
    out = json.loads(capsys.readouterr().out)
    assert {"requests", "ok", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
            "itl_p99_s", "handoff_p50_s", "peak_pool_pages", "leaked_pages", "wall_s"} <= set(out)
    assert (out["requests"], out["ok"], out["peak_pool_pages"], out["leaked_pages"]) == (4, 4, 5, 0)
    assert out["ttft_p50_s"] <= out["ttft_p99_s"] and out["itl_p50_s"] <= out["itl_p99_s"]
    assert all(set(r) == {"req", "status", "output", "ttft_s", "e2e_s", "attempts"}
               and r["ttft_s"] <= r["e2e_s"] for r in results)


def test_eos_ends_a_request_like_generate(tmp_path, checkpoint):
    """--eos-token: a request ends right after that token, exactly where generate stops."""
    prompts = drawn_prompts(tmp_path / "p.jsonl", 3, [40, 52, 61], 256, 0, 8, seed=4)
    eos = reference(checkpoint, prompts[0]["tokens"], 8, CHUNK, 0)[2]
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--prompts", str(tmp_path / "p.jsonl"),
        "--chunk", str(CHUNK), "--eos-token", str(eos), "--verify")
    assert code == 0
    assert results[0]["output"][-1] == eos and len(results[0]["output"]) <= 3
    for line, r in zip(prompts, results, strict=True):
        assert r["output"] == reference(checkpoint, line["tokens"], 8, CHUNK, 0, eos=eos)
    trace_ok(trace)


def test_verify_turns_a_dropped_last_row_into_fail(tmp_path, checkpoint):
    """A copy that drops each span's last token row, --verify on by default: every span
    fails, no wrong answer, and the trace header says verify was on."""
    drawn_prompts(tmp_path / "p.jsonl", 2, [40, 50], 256, 0, 3)
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--prompts", str(tmp_path / "p.jsonl"),
        "--chunk", str(CHUNK), "--debug", "drop-last-row", "--retries", "1")
    assert json.loads(trace[0])["verify"] is True
    assert code == 1
    assert [r["status"] for r in results] == ["failed", "failed"]
    assert all(r["output"] == [] and r["attempts"] == 2 for r in results)
    fails = events_of(trace, "fail")
    assert fails and all("checksum mismatch" in f["error"] for f in fails)
    assert not events_of(trace, "admit")
    trace_ok(trace)


def test_without_verify_a_dropped_row_is_a_wrong_answer(tmp_path, checkpoint):
    """The same bug with --no-verify passes every live check but changes the tokens."""
    prompts = drawn_prompts(tmp_path / "p.jsonl", 2, [40, 50], 256, 0, 6)
    code, results, trace = serve(
        tmp_path, "--model", checkpoint, "--prompts", str(tmp_path / "p.jsonl"),
        "--chunk", str(CHUNK), "--debug", "drop-last-row", "--no-verify")
    assert json.loads(trace[0])["verify"] is False
    assert code == 0 and all(r["status"] == "ok" for r in results)
    trace_ok(trace)
    wrong = [r for line, r in zip(prompts, results, strict=True)
             if r["output"] != reference(checkpoint, line["tokens"], 6, CHUNK, 0)]
    assert wrong  # what --verify is for


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_a_producer_that_gives_its_pages_back_early_is_a_violation(tmp_path, mode, capsys):
    """A producer that gives a life's source pages back at `produced` while its last spans
    are still to be copied (--debug early-reuse): its give-back is a `reuse` the decoder's
    live check refuses (COPY-3) or a span issued from those tokens after it is (COPY-1);
    exit 1, one line naming the producer, the trace closed legal."""
    drawn_prompts(tmp_path / "p.jsonl", 3, [60, 70, 64], 256, 0, 4)
    code, _, trace = serve(tmp_path, "--prompts", str(tmp_path / "p.jsonl"), "--mode", mode,
                           "--chunk", str(CHUNK), "--debug", "early-reuse")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    refused = re.match(r"pdgpu: violation: (COPY-[13]) .*producer p1", err[0])
    assert refused, err
    if refused.group(1) == "COPY-1":  # the give-back was accepted, the late span refused
        assert events_of(trace, "reuse")  # so the give-back is in the trace, before the stop
    else:  # the give-back itself was refused (never written): its span was issued, unlanded
        span = re.search(r"while span (\S+) in flight", err[0]).group(1)
        issued = {str(e["span"]) for e in events_of(trace, "issue")}
        landed = {str(e["span"]) for e in events_of(trace, "land")}
        assert span in issued and span not in landed, err
    trace_ok(trace)


def test_a_protocol_break_in_a_producer_stops_the_run_with_its_code(tmp_path, capsys):
    """A producer that announces a span before computing it: the decoder's live check stops
    the run with COPY-1 (exit 1, one line); the trace up to there, aborted, is legal."""
    drawn_prompts(tmp_path / "p.jsonl", 2, [40, 50], 256, 0, 3)
    code, results, trace = serve(tmp_path, "--prompts", str(tmp_path / "p.jsonl"),
                                 "--chunk", str(CHUNK), "--debug", "issue-early")
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "COPY-1" in err[0], err
    assert {r["status"] for r in results} == {"cancelled"}
    trace_ok(trace)


def test_row_digest_sees_one_ulp_and_names_the_row():
    """A one-ulp change of one element changes exactly that row's digest."""
    kv = torch.randn(3, 2, 5, 2, 16)
    expected = row_digests(kv)
    assert first_mismatch(kv, expected) is None
    bad = kv.clone()
    bad[1, 0, 4, 1, 7] = torch.nextafter(bad[1, 0, 4, 1, 7], torch.tensor(10.0))
    assert first_mismatch(bad, expected) == (1, 4)


def test_refusal_rules():
    """Layer mode with recurrent state is CFG-1; streaming needs kv_progress; whole is fine."""
    plain = producer_capabilities("p1", recurrent=False, kv_progress=True)
    hybrid = producer_capabilities("p2", recurrent=True, kv_progress=True)
    blind = producer_capabilities("p3", recurrent=False, kv_progress=False)
    assert refusal(Mode.LAYER, [plain]) is None
    assert "CFG-1" in refusal(Mode.LAYER, [plain, hybrid])
    assert refusal(Mode.CHUNK, [hybrid]) is None
    assert "kv_progress" in refusal(Mode.CHUNK, [blind])
    assert refusal(Mode.WHOLE, [blind, hybrid]) is None
    assert Capabilities.from_json(hybrid.to_json()) == hybrid
