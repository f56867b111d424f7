"""A workload read from a request trace file, as a stream: one request per row, in order.

CSV with a header row, or JSON lines (one object per line), with per request:

- its arrival: `arrival` (seconds) or `TIMESTAMP` (a date and time, as the Azure LLM
  inference traces give it: `2023-11-16 18:15:46.6805900`; seconds from the first row's);
- its prompt tokens: `prompt` or `ContextTokens` (>= 1);
- its output tokens (optional: else the run's --output-tokens): `output` or
  `GeneratedTokens` (>= 0).

Other columns are ignored. Arrivals must not decrease from one row to the next (the
simulator reads them as they come). `--requests N` reads the first N rows. Requests are
named r0, r1, ... in file order. The file is read each time the workload is iterated
(once to check it and size the run, once to play it), never held whole.
"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

from pdsim.core.config import RequestSpec
from pdsim.core.workload_rules import WorkloadError, checked_prefix

ARRIVAL, PROMPT, OUTPUT = ("arrival", "TIMESTAMP"), ("prompt", "ContextTokens"), (
    "output", "GeneratedTokens")
CONFLICTS = (("--rate", "rate"), ("--interval", "interval"), ("--arrivals", "arrivals"),
             ("--prompt-range", "prompt_range"), ("--prompts-csv", "prompts_csv"),
             ("--prompts", "prompts_jsonl"), ("--output-range", "output_range"),
             ("--arrival-shape", "arrival_shape"))


class TraceFileWorkload:
    """The requests of `spec.trace_file` (see the module docstring), read as a stream."""

    def __init__(self, spec, page_tokens: int) -> None:
        given = [flag for flag, field in CONFLICTS if getattr(spec, field) is not None]
        if given:
            raise WorkloadError(f"--workload gives arrivals, prompts and outputs: give it "
                                f"without {' and '.join(given)}")
        if spec.requests is not None and spec.requests < 1:
            raise WorkloadError(f"--requests must be >= 1, got {spec.requests}")
        self.spec, self.page_tokens, self.path = spec, page_tokens, spec.trace_file

    def __iter__(self):
        spec, count, last = self.spec, 0, 0.0
        origin = None  # the first row's time, for date-and-time arrivals
        for line, row in self._rows():
            if spec.requests is not None and count == spec.requests:
                return
            arrival, prompt, output = self._fields(line, row)
            if isinstance(arrival, datetime):
                origin = arrival if origin is None else origin
                arrival = (arrival - origin).total_seconds()
            if not arrival >= last:
                raise WorkloadError(f"{self._at(line)}: arrival {arrival} is before the row "
                                    f"before it ({last}): rows must be in arrival order")
            last = arrival
            prefix = checked_prefix(spec.prefix or 0, prompt, self.page_tokens)
            yield RequestSpec(f"r{count}", arrival, prompt, prefix, output)
            count += 1
        if count == 0 or (spec.requests is not None and count < spec.requests):
            raise WorkloadError(f"--workload: {self.path} has {count} requests"
                                + (f", --requests asks for {spec.requests}"
                                   if spec.requests else ""))

    def _rows(self):
        """(line number, dict) of each row of the file."""
        try:
            with open(Path(self.path), newline="", encoding="utf-8") as f:
                if str(self.path).endswith(".csv"):
                    yield from enumerate(csv.DictReader(f), 2)
                    return
                for line, text in enumerate(f, 1):
                    if text.strip():
                        yield line, self._json(line, text)
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise WorkloadError(f"--workload: cannot read {self.path}: {e}") from None

    def _json(self, line: int, text: str) -> dict:
        try:
            row = json.loads(text)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise WorkloadError(f"{self._at(line)}: not a JSON object")
        return row

    def _fields(self, line: int, row: dict):
        """(arrival: seconds or a datetime, prompt, output or None) of a row."""
        arrival = self._field(line, row, ARRIVAL, _arrival)
        prompt = self._field(line, row, PROMPT, _integer)
        output = self._field(line, row, OUTPUT, _integer, optional=True)
        self._check(line, prompt >= 1, "prompt must be >= 1")
        self._check(line, output is None or output >= 0, "output must be >= 0")
        return arrival, prompt, output

    def _field(self, line: int, row: dict, names: tuple[str, ...], convert,
               optional: bool = False):
        name = next((n for n in names if row.get(n) not in (None, "")), None)
        if name is None:
            if optional:
                return None
            raise WorkloadError(f"{self._at(line)}: {' or '.join(names)} is missing")
        try:
            return convert(row[name])
        except (TypeError, ValueError):
            raise WorkloadError(f"{self._at(line)}: {name} {row[name]!r} is not "
                                f"{'a time' if names is ARRIVAL else 'an integer'}") from None

    def _check(self, line: int, ok: bool, rule: str) -> None:
        if not ok:
            raise WorkloadError(f"{self._at(line)}: {rule}")

    def _at(self, line: int) -> str:
        return f"--workload: {self.path}:{line}"


def _arrival(value):
    """Seconds (a number >= 0), or a date and time (a string that is not a number)."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        try:
            seconds = float(value)
        except ValueError:
            return datetime.fromisoformat(value.strip())
    if not seconds >= 0:
        raise ValueError(value)
    return seconds


def _integer(value) -> int:
    """An integer, or a string of one (a float, even a whole one, is refused)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        return int(value)
    raise ValueError(value)
