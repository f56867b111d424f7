"""The shipped example traces: legal ones check ok, each illegal one triggers its named code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdref.check import check_file
from pdref.fast_monitor import FastMonitor
from pdref.monitor import Monitor
from pdref.trace import read_trace
from pdref.violations import CODES, Violation

EXAMPLES = Path(__file__).resolve().parent.parent / "specs" / "examples"
ALL = sorted(EXAMPLES.glob("*.jsonl"))
CODE_RE = re.compile(r"illegal-([A-Z]+-\d)-")


@pytest.mark.parametrize("path", [p for p in ALL if p.name.startswith("legal-")], ids=str)
def test_legal_example_checks_ok(path):
    """A shipped legal example passes the checker."""
    result = check_file(path)
    assert result.ok, result.text()


@pytest.mark.parametrize("path", [p for p in ALL if p.name.startswith("illegal-")], ids=str)
def test_illegal_example_triggers_its_code(path):
    """A shipped illegal example is refused with the code in its name."""
    result = check_file(path)
    assert not result.ok
    assert result.code == CODE_RE.match(path.name).group(1), result.text()


def _monitor_verdict(cls, path):
    """(code, message, events accepted) of a monitor of class `cls` fed the example's
    events; None when it accepts the whole trace. A form error (TRACE-1/2 of the parser)
    is the parser's, before any monitor."""
    try:
        header, *events = [item for _, item in read_trace(path)]
    except Violation as v:
        return v.code, v.message, 0
    monitor = None
    try:
        monitor = cls(header)
        for event in events:
            monitor.emit(event)
        monitor.close()
    except Violation as v:
        return v.code, v.message, monitor.events if monitor is not None else 0
    return None


@pytest.mark.parametrize("path", ALL, ids=str)
def test_both_monitors_give_the_checkers_verdict(path):
    """Every example, legal or not, through the specification (Monitor) and the fast mirror
    (FastMonitor) event by event: the same code, message and event as `pdref check`."""
    result = check_file(path)
    slow, fast = _monitor_verdict(Monitor, path), _monitor_verdict(FastMonitor, path)
    assert fast == slow
    assert (None if result.ok else (result.code, result.message)) == (slow and slow[:2])


def test_every_code_has_an_example():
    """Every violation code of the contract has at least one shipped example."""
    named = {CODE_RE.match(p.name).group(1) for p in ALL if p.name.startswith("illegal-")}
    assert named == set(CODES)


def test_examples_are_up_to_date(tmp_path, monkeypatch):
    """Regenerating the examples gives the shipped files byte for byte."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_examples", EXAMPLES.parent.parent / "scripts" / "make_examples.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", tmp_path)
    module.main()
    fresh = {p.name: p.read_bytes() for p in tmp_path.glob("*.jsonl")}
    shipped = {p.name: p.read_bytes() for p in ALL}
    assert fresh == shipped
