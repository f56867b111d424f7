"""pdgpu serve under faults (issue 10): each fault kind on a short run. Every run: the ok
requests' tokens equal the fault-free reference, the trace is legal under pdref (v2 fences,
COPY-5, COV-3 live and again here), 0 leaked pages, every request ends ok | cancelled |
failed (with a reason), and no producer process outlives the run (serve_helpers.serve)."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time

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
from wait_helpers import in_thread

from pdgpu.serve.faults import Fate, FaultSpec
from pdgpu.serve.recovery import Recovery

CHUNK = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_sensitive_checkpoint(tmp_path_factory.mktemp("ckpt") / "sensitive"))


@functools.cache
def _reference(model: str, tokens: tuple[int, ...], out: int) -> list[int]:
    return reference(model, tokens, out, CHUNK, 0)


def _run(tmp_path, capsys, model, count, out, *args, lengths=(40, 64, 33, 50)):
    """Serve drawn prompts with these options; (exit code, results, trace, summary) after
    the checks every faulty run must pass."""
    prompts = drawn_prompts(tmp_path / "p.jsonl", count, list(lengths), 256, 0, out)
    code, results, trace = serve(
        tmp_path, "--model", model, "--prompts", str(tmp_path / "p.jsonl"), "--chunk",
        str(CHUNK), "--json", "--verify", *args)
    summary = json.loads(capsys.readouterr().out)
    trace_ok(trace)
    assert summary["leaked_pages"] == 0
    assert len(results) == count
    for line, r in zip(prompts, results, strict=True):
        assert r["status"] in ("ok", "cancelled", "failed"), r
        if r["status"] == "ok":
            assert r["output"] == _reference(model, tuple(line["tokens"]), out), r["req"]
        else:
            assert r["reason"] and r["output"] == [], r
    counts = {s: sum(r["status"] == s for r in results) for s in ("ok", "cancelled", "failed")}
    assert counts == {s: summary[s] for s in counts}
    assert code == (1 if counts["failed"] else 0)
    _fences_follow_fails(trace)
    return code, results, trace, summary


def _fences_follow_fails(trace) -> None:
    """Every failed span is fenced exactly once, at or after its fail."""
    fail_t = {e["span"]: e["t"] for e in events_of(trace, "fail")}
    fences = events_of(trace, "fence")
    assert sorted(e["span"] for e in fences) == sorted(set(e["span"] for e in fences))
    for e in fences:
        if e["span"] in fail_t:
            assert e["t"] >= fail_t[e["span"]]


def test_failed_copies_are_fenced_aborted_and_retried(tmp_path, capsys, checkpoint):
    """--fail-rate: each failed span is fail + fence, its life aborted and tried again; a
    request whose every life failed ends failed after --max-attempts lives."""
    _, results, trace, summary = _run(tmp_path, capsys, checkpoint, 10, 4,
                                      "--fail-rate", "0.35", "--max-attempts", "2")
    fails = events_of(trace, "fail")
    assert fails and all(f["error"] == "copy failed (injected)" for f in fails)
    assert summary["lives"] > 10 and summary["ok"] >= 1
    assert all(r["attempts"] == 2 for r in results if r["status"] == "failed")


def test_stalled_spans_time_out_and_their_pages_wait_for_the_fence(tmp_path, capsys,
                                                                   checkpoint):
    """--stall-rate with --span-timeout: a stalled span fails at its deadline; its writer is
    fenced only when the producer acknowledged the cancel; the retry ends ok."""
    _, results, trace, summary = _run(tmp_path, capsys, checkpoint, 8, 3,
                                      "--stall-rate", "0.3", "--span-timeout", "0.3")
    timed_out = [f for f in events_of(trace, "fail") if "not landed within 0.3 s" in f["error"]]
    assert timed_out
    fence_t = {e["span"]: e["t"] for e in events_of(trace, "fence")}
    assert all(fence_t[f["span"]] >= f["t"] for f in timed_out)
    assert summary["ok"] >= 6


def test_late_bytes_of_a_timed_out_span_are_dropped(tmp_path, capsys, checkpoint):
    """A link so slow that every span misses its deadline: its bytes arrive late and are
    never written (no land at all); every request fails with the deadline as its reason.
    Without the prefix cache: with it a retry's producer hit sends smaller spans, which may
    land in time."""
    _, results, trace, summary = _run(tmp_path, capsys, checkpoint, 2, 2, "--link-gbps",
                                      "0.00002", "--span-timeout", "0.1", "--max-attempts",
                                      "2", "--no-prefix-cache", lengths=(20, 24))
    assert not events_of(trace, "land") and not events_of(trace, "admit")
    assert [r["status"] for r in results] == ["failed", "failed"]
    assert all("not landed within 0.1 s" in r["reason"] for r in results)


def test_corrupted_bytes_are_caught_by_verify(tmp_path, capsys, checkpoint):
    """--corrupt-rate: one bit altered in transit; --verify fails the span, never a wrong
    token."""
    _, _, trace, summary = _run(tmp_path, capsys, checkpoint, 8, 4, "--corrupt-rate", "0.4")
    fails = events_of(trace, "fail")
    assert fails and all("checksum mismatch" in f["error"] for f in fails)
    assert summary["ok"] >= 1


def test_cancel_rate_cancels_in_every_phase_without_leaking(tmp_path, capsys, checkpoint):
    """--cancel-rate: cancelled requests abort in the queue, during prefill and copies, or
    while decoding; each writer is fenced, the pool comes back whole."""
    _, results, trace, summary = _run(tmp_path, capsys, checkpoint, 12, 6,
                                      "--cancel-rate", "0.6", "--concurrency", "4")
    cancelled = [r for r in results if r["status"] == "cancelled"]
    assert cancelled and all(r["reason"] == "cancelled" for r in cancelled)
    aborts = [a for a in events_of(trace, "abort") if a["reason"] == "cancelled"]
    admitted = {a["req"] for a in events_of(trace, "admit")}
    phases = {"queue" if r["attempts"] == 0 else
              "decode" if r["req"] in admitted else "prefill" for r in cancelled}
    assert len(phases) >= 2, phases
    assert len(aborts) == sum(r["attempts"] > 0 for r in cancelled)


def test_a_killed_producer_is_found_and_its_requests_served_by_the_other(tmp_path, capsys,
                                                                         checkpoint):
    """--kill-producer 0@T: SIGKILL of p1 mid-run; its spans fail and are fenced, its lives
    retried on p2; serving goes on and every request ends ok."""
    _, results, trace, summary = _run(
        tmp_path, capsys, checkpoint, 40, 4, "--producers", "2", "--concurrency", "4",
        "--kill-producer", "0@0.4", "--link-gbps", "0.0005")
    assert summary["producer_deaths"] == 1 and summary["ok"] == 40
    reserves = events_of(trace, "reserve")
    assert {r["producer"] for r in reserves if r["t"] > 1.0} == {"p2"}
    assert any(r["t"] < 0.4 for r in reserves if r["producer"] == "p1")


def test_killed_producers_restart_and_rejoin(tmp_path, capsys, checkpoint):
    """--restart-producers: a killed producer is respawned, rejoins with a new handshake on a
    new link, and serves again; each kill that hit a serving producer is one death and one
    restart."""
    _, results, trace, summary = _run(
        tmp_path, capsys, checkpoint, 100, 2, "--producers", "2", "--concurrency", "4",
        "--kill-producer", "0@0.3", "--kill-producer", "0@2.5", "--restart-producers",
        "--link-gbps", "0.0005")
    kills = summary["producer_kills"]
    assert kills >= 1 and summary["producer_deaths"] == summary["producer_restarts"] == kills
    assert summary["ok"] == 100
    p1 = [r["t"] for r in events_of(trace, "reserve") if r["producer"] == "p1"]
    assert any(t > 0.3 for t in p1)  # it served again after it was killed


@pytest.mark.parametrize("mode", ["whole", "layer"])
def test_every_fault_at_once_in_whole_and_layer_mode(tmp_path, capsys, checkpoint, mode):
    """Fail, stall, corrupt, cancel and a killed-and-restarted producer together, with one
    span per request (whole) or one per layer: the same guarantees as in chunk mode."""
    _, results, trace, summary = _run(
        tmp_path, capsys, checkpoint, 40, 3, "--mode", mode, "--producers", "2",
        "--concurrency", "4", "--fail-rate", "0.1", "--stall-rate", "0.05", "--span-timeout",
        "0.3", "--corrupt-rate", "0.1", "--cancel-rate", "0.1", "--kill-producer", "0@0.3",
        "--restart-producers", "--link-gbps", "0.0005")
    assert events_of(trace, "fail") and summary["cancelled"] and summary["ok"] >= 20
    assert summary["producer_restarts"] >= summary["producer_deaths"] == summary["producer_kills"]


@pytest.fixture
def started(monkeypatch):
    """The next in-process run's Decoder, once its serving loop starts."""
    return watch_decoder(monkeypatch)


def test_a_hung_producer_is_declared_dead_by_its_heartbeat(tmp_path, capsys, checkpoint,
                                                          started):
    """A producer stopped (SIGSTOP: alive, silent) while serving is declared dead after
    --heartbeat-timeout, killed, and its requests served by the other."""
    stopped = []

    def stop_p1():
        if started["event"].wait(120):
            time.sleep(0.3)
            os.kill(started["decoder"].members.processes.procs[1].pid, signal.SIGSTOP)
            stopped.append(True)

    finish = in_thread(stop_p1)
    _, results, trace, summary = _run(
        tmp_path, capsys, checkpoint, 60, 4, "--producers", "2", "--concurrency", "4",
        "--heartbeat-timeout", "1", "--link-gbps", "0.0005")
    finish()
    assert stopped == [True], "the decoder never started, so no producer was stopped"
    assert summary["producer_deaths"] == 1 and summary["ok"] == 60
    reasons = [e["reason"] for e in events_of(trace, "abort")]
    assert any("silent for 1 s" in r for r in reasons), reasons  # the heartbeat found it


class Turnstile:
    """Holds the decoder's loop at each turn, just before its checks apply the cancels queued
    so far, while another thread looks at its requests and cancels some (`visit`): what that
    thread sees is what the cancels are applied to, however late either thread runs."""

    def __init__(self, monkeypatch) -> None:
        self.barrier, self.open = threading.Barrier(2, timeout=120), False
        watch = Recovery.watch

        def held(recovery):
            if not self.open:
                self.barrier.wait()  # the visitor looks now ...
                self.barrier.wait()  # ... and has cancelled what it chose
            watch(recovery)
        monkeypatch.setattr(Recovery, "watch", held)

    def visit(self, look) -> None:
        """`look()` at each turn while the loop is held, until it returns True or raises
        (then the loop runs freely again), or until `close`."""
        try:
            while not self.open:
                self.barrier.wait()
                try:
                    self.open = look()
                except BaseException:
                    self.open = True
                    raise
                finally:
                    self.barrier.wait()
        except threading.BrokenBarrierError:  # closed: the run ended first
            return

    def close(self) -> None:
        self.open = True
        self.barrier.abort()


def test_the_cancel_call_ends_a_request_in_any_phase(tmp_path, capsys, checkpoint, started,
                                                      monkeypatch):
    """Decoder.cancel (the serving API, from another thread): a request not yet arrived, one
    with spans in flight, one decoding: each ends cancelled, nothing leaks, the others ok."""
    chosen, seen = {}, {}
    turnstile = Turnstile(monkeypatch)

    def look() -> bool:  # on this thread, the decoder's loop held; True once all are chosen
        decoder = started["decoder"]
        if "future" not in chosen:
            try:
                decoder.cancel("no-such-request")
                seen["unknown"] = "accepted"
            except KeyError:
                seen["unknown"] = "KeyError"
            chosen["future"] = "q11"
            decoder.cancel("q11")
        for phase, want in (("copying", lambda t: t.status == "prefill" and t.life and any(
                                s is not None for s in t.life.spans.values())),
                            ("decoding", lambda t: t.status == "running" and len(t.output) > 2)):
            if phase not in chosen:
                t = next((t for t in decoder.tracked.values()
                          if want(t) and t.req not in chosen.values()), None)
                if t is not None:
                    chosen[phase] = t.req
                    decoder.cancel(t.req)
        return len(chosen) == 3

    def cancel_some():  # records what it saw; the test asserts on its own thread
        seen["started"] = started["event"].wait(120)
        if seen["started"]:
            turnstile.visit(look)

    finish = in_thread(cancel_some)
    try:
        _, results, trace, summary = _run(
            tmp_path, capsys, checkpoint, 12, 24, "--concurrency", "2", "--link-gbps", "0.0002")
    finally:
        turnstile.close()
        finish()
    assert seen == {"started": True, "unknown": "KeyError"}, seen
    assert len(chosen) == 3, f"no request reached every phase: {chosen}"
    by_req = {r["req"]: r for r in results}
    assert {phase: by_req[req]["status"] for phase, req in chosen.items()} == {
        "future": "cancelled", "copying": "cancelled", "decoding": "cancelled"}
    assert by_req["q11"]["attempts"] == 0
    assert summary["cancelled"] == 3 and summary["ok"] == 9
    copying = chosen["copying"]  # aborted with spans in flight: fenced after its abort
    abort_t = [a["t"] for a in events_of(trace, "abort") if a["req"] == copying]
    fences = [f["t"] for f in events_of(trace, "fence") if f["req"] == copying]
    assert len(abort_t) == 1 and fences and min(fences) >= abort_t[0]


def test_fault_draws_are_pure_functions_of_the_seed():
    """The same (seed, life, region) always draws the same fate; rates near 0 and 1 hold."""
    spec = FaultSpec(fail_rate=0.5, seed=7)
    fates = [spec.span_fate(f"r{i}#1", (0, 2), (0, 16)) for i in range(400)]
    assert fates == [spec.span_fate(f"r{i}#1", (0, 2), (0, 16)) for i in range(400)]
    assert 150 < fates.count(Fate.FAIL) < 250
    assert all(FaultSpec(stall_rate=1.0).span_fate("a#1", (0, 1), (0, 1)) is Fate.STALL
               for _ in range(3))
    assert FaultSpec(cancel_rate=0.0).cancel_step("r1", 10) is None
    assert 0 <= FaultSpec(cancel_rate=1.0).cancel_step("r1", 10) < 10
