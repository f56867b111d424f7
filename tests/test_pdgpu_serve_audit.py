"""pdgpu serve's live checks off the critical path: the decoder's Ledger decides from pdref's
fast mirror, and a violation or disagreement only the Monitor behind it finds stops the run
with its code (exit 1, one line), the trace closed as after a live violation."""

from __future__ import annotations

import json

import pytest
import torch
from serve_helpers import drawn_prompts, serve, trace_ok
from wait_helpers import wait_for

import pdgpu.serve.launch as launch_module
from pdgpu.serve.decoder import ServeError
from pdgpu.serve.digest import row_digests
from pdgpu.serve.ledger import Ledger
from pdgpu.serve.tracelog import TraceLog
from pdref import events as ev
from pdref.geometry import Geometry
from pdref.monitor import Monitor
from pdref.trace import read_trace
from pdref.violations import Violation

CHUNK = 16
BOUND = 4  # the audit's backlog bound in the bounded-delay test


class _RefusesSecondIssue(Monitor):
    """The specification, but it refuses the second issue of the run (the mirror accepts)."""

    issues = 0

    def emit(self, event):
        if isinstance(event, ev.Issue):
            type(self).issues += 1
            if type(self).issues == 2:
                raise Violation("COPY-2", "refused by the audit alone", event)
        super().emit(event)


class _NeverAdmits(Monitor):
    def can_admit(self, req: str) -> bool:
        return False


def _serve_audited(monkeypatch, tmp_path, monitor_cls, bound: int):
    """A two-request serve run whose Ledger audits with `monitor_cls` (backlog `bound`)."""
    def ledger(*args, **kwargs):
        return Ledger(*args, audit_monitor=monitor_cls, audit_bound=bound, **kwargs)

    monkeypatch.setattr(launch_module, "Ledger", ledger)
    drawn_prompts(tmp_path / "p.jsonl", 2, [40, 50], 256, 0, 3)
    return serve(tmp_path, "--prompts", str(tmp_path / "p.jsonl"), "--chunk", str(CHUNK))


@pytest.mark.parametrize("bound", [BOUND, 256])
def test_a_violation_only_the_audit_finds_stops_the_serve_run(monkeypatch, tmp_path, capsys,
                                                              bound):
    """An issue the mirror accepts and the audit refuses: exit 1 with one line naming the
    audit's code and message; the issue is in the trace (it happened) and the trace closes
    with every life aborted (legal to pdref check). With a small backlog bound the run's own
    events after it are at most the bound + 1, too few for any request to end ok."""
    _RefusesSecondIssue.issues = 0
    code, results, trace = _serve_audited(monkeypatch, tmp_path, _RefusesSecondIssue, bound)
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pdgpu: violation: COPY-2 refused by the audit alone"], err
    trace_ok(trace)
    protocol = [e for e in map(json.loads, trace[1:]) if e["kind"] != "stage"]
    second = [i for i, e in enumerate(protocol) if e["kind"] == "issue"][1]
    teardown = next(i for i, e in enumerate(protocol)
                    if e["kind"] == "abort" and e["reason"].startswith("stopped:"))
    assert second < teardown
    if bound == BOUND:
        assert teardown - 1 - second <= BOUND + 1, protocol[second:teardown]
        assert "ok" not in {r["status"] for r in results}


@pytest.mark.parametrize("stop", [ServeError("a producer sent nonsense"), KeyboardInterrupt()],
                         ids=["serve-error", "ctrl-c"])
def test_an_audit_finding_is_the_cause_whatever_stops_the_serve_run(monkeypatch, tmp_path,
                                                                     capsys, stop):
    """The audit refuses the second issue and the decoder stops right after it (an error of
    its own, or Ctrl-C) before its next call into the ledger could raise the audit's
    finding: the teardown drains the audit, and the run ends with the violation (exit 1,
    its one line), the trace closed legal."""
    from pdgpu.serve import ledger as ledger_module
    issue = ledger_module.Ledger.issue
    issued = []

    def issue_then_stop(self, *args):
        span = issue(self, *args)
        issued.append(span)
        if len(issued) == 2:
            raise stop
        return span
    monkeypatch.setattr(ledger_module.Ledger, "issue", issue_then_stop)
    _RefusesSecondIssue.issues = 0
    code, _, trace = _serve_audited(monkeypatch, tmp_path, _RefusesSecondIssue, 256)
    err = capsys.readouterr().err.strip().splitlines()
    assert (code, err) == (1, ["pdgpu: violation: COPY-2 refused by the audit alone"])
    trace_ok(trace)


def test_an_answer_the_audit_gives_differently_stops_the_serve_run(monkeypatch, tmp_path,
                                                                   capsys):
    """When the Monitor behind answers can_admit unlike the mirror, the run stops with one
    line naming the disagreement and the query, exit 1; the trace closes legal."""
    code, results, trace = _serve_audited(monkeypatch, tmp_path, _NeverAdmits, 256)
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Disagreement" in err[0] and "can_admit" in err[0], err
    trace_ok(trace)


class _Witness(Monitor):
    """The specification, keeping every protocol event it applied (class-wide: one run)."""

    applied: list = []

    def emit(self, event):
        super().emit(event)
        if type(event) is not ev.Stage:
            type(self).applied.append(event)


def test_the_trace_holds_exactly_what_the_full_monitor_applied(monkeypatch, tmp_path):
    """The trace's protocol events are, in order and field for field, the events the
    specification's Monitor behind the mirror applied: the trace's content is what the
    Monitor in line used to write, and pdref check accepts it."""
    _Witness.applied = []
    code, _, trace = _serve_audited(monkeypatch, tmp_path, _Witness, 256)
    assert code == 0
    trace_ok(trace)
    written = [e for _, e in read_trace(tmp_path / "trace.jsonl")
               if not isinstance(e, ev.Header) and type(e) is not ev.Stage]
    assert written == _Witness.applied and len(written) > 10


GEO = Geometry(layers=2, kv_heads=2, head_dim=4, dtype_bytes=4, page_tokens=4)


def test_after_the_audit_refuses_the_ledger_writes_nothing_more(tmp_path):
    """Once the audit refused an event, the ledger's next operation raises that Violation
    and writes no byte into the slab; the loop's per-turn check raises it too."""
    _RefusesSecondIssue.issues = 0
    header = ev.Header("test", "chunk", GEO, 4, 2)
    ledger = Ledger(header, "cpu", torch.float32, TraceLog(header, tmp_path / "t.jsonl"),
                    audit_monitor=_RefusesSecondIssue)
    try:
        ledger.reserve("r", 8, 0, "p1")
        ledger.computed("r", (0, 2), (0, 8))
        spans = [ledger.issue("r", (0, 2), t, GEO.region_bytes((0, 2), t))
                 for t in ((0, 4), (4, 8))]
        wait_for(lambda: ledger.live.audit.error is not None)  # the audit saw the second issue
        kv = torch.randn(2, 2, 4, 2, 4)
        before = ledger.kv_landing.kv.clone()
        with pytest.raises(Violation, match="refused by the audit alone"):
            ledger.land("r", spans[0], kv, row_digests(kv))
        with pytest.raises(Violation, match="COPY-2"):
            ledger.raise_audit_error()
        assert torch.equal(ledger.kv_landing.kv, before)
    finally:
        ledger.stop()  # its audit thread (the exceptions above keep the ledger alive)


def test_serve_summary_reports_live_check_cost_and_audit_lag(tmp_path, capsys):
    """`--json` keeps its keys and adds check_s, check_frac (of wall_s), checks and the
    audit's lag and seconds; the audit went through every protocol event of the trace."""
    drawn_prompts(tmp_path / "p.jsonl", 2, [40, 50], 256, 0, 3)
    code, _, trace = serve(tmp_path, "--prompts", str(tmp_path / "p.jsonl"), "--chunk",
                           str(CHUNK), "--json")
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert {"wall_s", "verify_s", "leaked_pages", "tokens_per_s"} <= set(out)
    assert out["check_frac"] == pytest.approx(out["check_s"] / out["wall_s"])
    protocol = [e for e in map(json.loads, trace[1:]) if e["kind"] != "stage"]
    assert out["checks"] >= len(protocol)
    assert out["audit_items"] > len(protocol)  # + the queries and the end-of-run state
    assert out["audit_lag_max_s"] >= out["audit_lag_p50_s"] > 0
    assert out["audit_s"] > 0 and out["audit_drain_s"] >= 0 and out["audit_waits"] >= 0

