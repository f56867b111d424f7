"""Writing results: metrics as text or JSON, traces and files atomically."""

from __future__ import annotations

import json
from pathlib import Path

from pdref.cli_format import format_metrics
from pdref.outfile import write_atomic
from pdref.trace import TraceWriter
from pdsim.sim import SimResult

__all__ = ["format_metrics", "write_atomic", "write_json", "write_trace"]


def write_trace(path: str, result: SimResult) -> None:
    """The run's contract-v1 JSONL trace, written atomically."""
    with TraceWriter(path, result.header) as writer:
        for event in result.events:
            writer.write(event)


def write_json(path: str | Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1) + "\n")
