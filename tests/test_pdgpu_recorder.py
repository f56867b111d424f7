"""pdgpu.recorder and pdgpu.audit: the fast mirror decides in line, the Monitor audits behind."""

from __future__ import annotations

import gc
import threading

import attrs
import pytest
import torch
from wait_helpers import wait_for

import pdgpu.engine as engine_module
from pdgpu.audit import Audit, Disagreement
from pdgpu.engine import Engine
from pdgpu.model import build_model
from pdgpu.recorder import Recorder
from pdgpu.workload import EngineConfig, Request
from pdref import events as ev
from pdref.check import check_lines
from pdref.models import load_model
from pdref.monitor import Monitor
from pdref.trace import dumps
from pdref.violations import Violation

TINY = attrs.evolve(load_model("tiny"), dtype="float32")
MODEL = build_model(TINY, seed=0)
GEOMETRY = TINY.geometry(16)
BOUND = 4  # the audit's backlog bound in these tests


def _request(prompt: int = 97) -> Request:
    gen = torch.Generator().manual_seed(0)
    return Request("r", tuple(torch.randint(0, TINY.vocab, (prompt,), generator=gen).tolist()), 0)


def _engine_run(monkeypatch, audit_monitor, recorders: list, mode: str = "chunk",
                bound: int = BOUND):
    """Run one request with `audit_monitor` behind the mirror (backlog bound `bound`); the
    run's Recorder goes into `recorders` before its first event."""
    def recorder(header):
        recorders.append(Recorder(header, audit_monitor=audit_monitor, audit_bound=bound))
        return recorders[-1]

    monkeypatch.setattr(engine_module, "Recorder", recorder)
    return Engine(MODEL, EngineConfig(mode, chunk=8, max_pending=2)).run([_request()])


def _refusing_second_issue(recorders: list, hold: bool):
    """A Monitor that refuses the second issue the mirror accepted; `hold`: only once the
    engine has run as far ahead of the audit as the backlog bound lets it (it waited)."""
    class Refusing(Monitor):
        issues = 0

        def emit(self, event):
            if isinstance(event, ev.Issue):
                Refusing.issues += 1
                if Refusing.issues == 2:
                    if hold:
                        wait_for(lambda: recorders[0].live.audit.waits > 0)
                    raise Violation("COPY-2", "refused by the audit alone", event)
            super().emit(event)

    return Refusing


@pytest.mark.parametrize("hold", [True, False])
def test_a_violation_only_the_audit_finds_stops_the_run_within_the_bound(monkeypatch, hold):
    """An issue the mirror accepts and the audit refuses stops the run with the audit's code
    and message at most BOUND + 1 events after it, long before the request is admitted:
    whether the engine was held by the backlog bound or ran freely and meets the error at
    its next call into pdref."""
    recorders: list = []
    with pytest.raises(Violation) as info:
        _engine_run(monkeypatch, _refusing_second_issue(recorders, hold), recorders)
    assert (info.value.code, info.value.message) == ("COPY-2", "refused by the audit alone")
    rec = recorders[0]
    second_issue = [i for i, e in enumerate(rec.protocol) if e.kind == "issue"][1]
    assert rec.live.audit.waits >= 1 or not hold
    assert len(rec.protocol) - 1 - second_issue <= BOUND + 1
    assert "admit" not in [e.kind for e in rec.protocol]


class _NeverIssues(Monitor):
    def can_issue(self, producer: str = "p0") -> bool:
        return False


def test_an_answer_the_audit_gives_differently_stops_the_run(monkeypatch):
    """When the Monitor behind answers a query the engine decided with (can_issue) unlike
    the mirror, the run stops with Disagreement naming the query."""
    with pytest.raises(Disagreement, match="can_issue"):
        _engine_run(monkeypatch, _NeverIssues, [])


def _header() -> ev.Header:
    return ev.Header("pdgpu", "chunk", GEOMETRY, 8, 2)


def test_a_mirror_that_drifts_without_an_event_is_caught():
    """Pages the mirror takes with no event: its free-page answer and its final state differ
    from the Monitor's, and closing the run raises Disagreement (the first: free_page_ids)."""
    rec = Recorder(_header())
    mirror = rec.live.monitor.mirror
    mirror.pool = mirror.pool.allocate(1)[0]
    rec.free_page_ids()
    with pytest.raises(Disagreement, match="free_page_ids"):
        rec.close()


def _one_life(rec: Recorder) -> list:
    """A legal life of 32 tokens in two spans, with stages reported late; returned events."""
    rec.reserve("r", 32, 0)
    out = rec.protocol[:1]
    for span, tokens in enumerate(((0, 16), (16, 32))):
        out.append(rec.emit(ev.Computed, "r", (0, TINY.layers), tokens))
        assert rec.ask("can_issue")
        nbytes = GEOMETRY.region_bytes((0, TINY.layers), tokens)
        out.append(rec.emit(ev.Issue, "r", span, (0, TINY.layers), tokens, nbytes))
    start = rec.now()
    for span in (0, 1):
        out.append(rec.emit(ev.Land, "r", span))
        rec.stage("r", "d2h", start, rec.now(), span, "link")
    out += [rec.emit(ev.Produced, "r", 7), rec.emit(ev.Reuse, "r", (0, 32))]
    assert rec.ask("can_admit", "r")
    out += [rec.emit(ev.Admit, "r"), rec.emit(ev.Release, "r")]
    return out


def test_the_trace_is_the_accepted_events_in_emission_order_and_the_audit_saw_each():
    """The trace holds exactly the events emitted, protocol events in emission order and
    stages merged by time; pdref check accepts it and the audit applied every one of them."""
    rec = Recorder(_header())
    emitted = _one_life(rec)
    rec.close()
    assert rec.protocol == emitted
    assert rec.trace() == sorted(emitted + rec.stages, key=lambda e: e.t)
    lines = [dumps(ev.header_to_json(rec.header)).encode()]
    lines += [dumps(ev.event_to_json(e)).encode() for e in rec.trace()]
    assert check_lines(lines).ok
    assert rec.live.audit.monitor.events == len(rec.trace())
    assert rec.live.audit.monitor.state == rec.live.monitor.state


def test_engine_metrics_report_the_audit_lag_beside_the_live_check_cost():
    """A run's metrics keep check_s/check_frac/checks and add the audit's lag and seconds;
    the audit went through every trace event and every query."""
    result = Engine(MODEL, EngineConfig("chunk", chunk=8, max_pending=2)).run([_request()])
    m = result.metrics
    assert m["check_frac"] == pytest.approx(m["check_s"] / m["wall_s"])
    assert m["checks"] >= len(result.events)
    assert m["audit_items"] > len(result.events)  # + queries and the end-of-run state
    assert m["audit_lag_max_s"] >= m["audit_lag_p50_s"] > 0
    assert m["audit_s"] > 0 and m["audit_drain_s"] >= 0 and m["audit_waits"] >= 0


def test_a_run_that_raises_leaves_no_audit_thread_running(monkeypatch):
    """A run stopped by a live violation ends its audit thread (no thread per failed run).
    Only the threads this run started are checked: an audit thread of a recorder another test
    dropped in a reference cycle lives until the garbage collector runs, and is not this one."""
    engine = Engine(MODEL, EngineConfig("chunk", chunk=8, max_pending=2, debug="early-reuse"))
    made, init = [], Audit.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self._thread)
    monkeypatch.setattr(Audit, "__init__", recording)
    before = set(threading.enumerate())
    with pytest.raises(Violation, match="COPY-3"):
        engine.run([_request()])
    started = set(threading.enumerate()) - before
    wait_for(lambda: not any(t.is_alive() for t in [*made, *started]))
    assert made and not any(t.is_alive() for t in made)
    assert not [t.name for t in started if t.is_alive()]


def test_a_recorder_dropped_without_close_ends_its_audit_thread():
    """A Recorder nobody closes (set up by hand, as tests do) is freed as soon as it is
    dropped, and its audit thread ends with it: no thread left waking in the background."""
    gc.disable()  # freed by reference counting alone, not by a later collection
    try:
        rec = Recorder(_header())
        thread = rec.live.audit._thread
        del rec
        wait_for(lambda: not thread.is_alive(), polls=2000)
    finally:
        gc.enable()
    assert not thread.is_alive()


def _refusing(kind: str):
    """The specification, but it refuses the run's first `kind` event (the mirror accepts)."""
    class Refusing(Monitor):
        def emit(self, event):
            if event.kind == kind:
                raise Violation("COPY-2", f"the audit alone refuses this {kind}", event)
            super().emit(event)
    return Refusing


def test_an_audit_finding_is_the_cause_of_a_run_another_error_stops(monkeypatch):
    """The audit refuses the first issue and the engine raises an error of its own right
    after it (before its next call into pdref could raise the audit's): the run's error is
    still the audit's violation, the engine's is only its context (rec.stop's path)."""
    import pdgpu.engine_ledger as ledger_module
    issue = ledger_module.EngineLedger.issue

    def issue_then_fail(self, *args):
        issue(self, *args)
        raise engine_module.EngineError("a secondary error")
    monkeypatch.setattr(ledger_module.EngineLedger, "issue", issue_then_fail)
    with pytest.raises(Violation, match="the audit alone refuses this issue") as info:
        # a backlog bound the run never reaches: at BOUND, a loaded box's audit could fall
        # that far behind and the issue's own emit would wait for it and raise its finding
        _engine_run(monkeypatch, _refusing("issue"), [], bound=4096)
    assert "secondary" in str(info.value.__cause__)


def test_an_audit_finding_is_not_lost_behind_a_late_copy_error(monkeypatch):
    """The audit refuses the run's release only once the copier has closed with an error
    (before `rec.close()` would have waited for the audit): the run's error is the
    violation, found by draining the audit, not the copy error."""
    import pdgpu.copier as copier_module
    closed = threading.Event()
    close = copier_module.Copier.close

    def close_with_an_error(self):
        close(self)
        self.callback_error = RuntimeError("a copy failed as the copier closed")
        closed.set()

    class RefusesReleaseLate(Monitor):
        def emit(self, event):
            if event.kind == "release":
                closed.wait(60)
                raise Violation("COPY-2", "the audit alone refuses this release", event)
            super().emit(event)

    def recorder(header):
        return Recorder(header, audit_monitor=RefusesReleaseLate, audit_bound=256)
    monkeypatch.setattr(copier_module.Copier, "close", close_with_an_error)
    monkeypatch.setattr(engine_module, "Recorder", recorder)
    engine = Engine(MODEL, EngineConfig("chunk", chunk=8, max_pending=2))
    with pytest.raises(Violation, match="the audit alone refuses this release") as info:
        engine.run([_request()])
    assert "copier closed" in str(info.value.__cause__)
