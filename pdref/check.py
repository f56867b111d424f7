"""Checking a whole trace against the specification, streaming, stopping at the first violation."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import attrs

from pdref.apply import apply, check_end, initial_state
from pdref.cli_format import count
from pdref.trace import parse_lines
from pdref.violations import Violation


@attrs.frozen
class CheckResult:
    """The verdict on one trace: ok, or the first violation's code, line and sentence."""

    file: str
    ok: bool
    events: int
    requests: int
    code: str | None = None
    line: int | None = None
    message: str | None = None

    def to_json(self) -> dict:
        return attrs.asdict(self)

    def text(self) -> str:
        if self.ok:
            return (f"{self.file}: ok: {count(self.events, 'event')}, "
                    f"{count(self.requests, 'request')}")
        return f"{self.file}:{self.line}: {self.code} {self.message}"


def check_lines(lines: Iterable[bytes], name: str = "<trace>", open_trace: bool = False):
    """Check a trace given as raw lines; `open_trace` skips the end-of-trace part of LIFE-1."""
    state, events, requests, last_line = None, 0, set(), 0
    try:
        for lineno, item in parse_lines(lines):
            last_line = lineno
            if state is None:
                state = initial_state(item)
                continue
            state = apply(state, item)
            events += 1
            if item.kind == "reserve":
                requests.add(item.req)
        if state is None:
            raise Violation("TRACE-1", "the trace is empty: a header is needed", line=1)
        if not open_trace:
            check_end(state)
    except Violation as v:
        line = v.line if v.line is not None else max(last_line, 1)
        return CheckResult(name, False, events, len(requests), v.code, line, v.message)
    return CheckResult(name, True, events, len(requests))


def check_file(path: str | Path, open_trace: bool = False) -> CheckResult:
    """Check one trace file; raises OSError when it cannot be read. `open_trace`: a trace
    still being written, whose last line may be caught halfway through its write: a last
    line without its newline is not checked (yet)."""
    with open(path, "rb") as f:
        return check_lines(_whole_lines(f) if open_trace else f, str(path), open_trace)


def _whole_lines(lines: Iterable[bytes]):
    for raw in lines:
        if not raw.endswith(b"\n"):
            return  # only the last line can lack it: its writer has not finished it
        yield raw
