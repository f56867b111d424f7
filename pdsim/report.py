"""Writing results: metrics as text or JSON, traces and files atomically."""

from __future__ import annotations

import json
from pathlib import Path

from pdref.outfile import write_atomic
from pdref.trace import TraceWriter
from pdsim.sim import SimResult

__all__ = ["format_metrics", "write_atomic", "write_json", "write_trace"]


def format_metrics(metrics: dict) -> str:
    """One `name: value` line per metric; seconds also in ms, bytes also in MiB."""
    lines = []
    for key, value in metrics.items():
        if isinstance(value, float) and key.endswith("_s"):
            text = f"{value:.6f}  ({value * 1e3:.3f} ms)"
        elif isinstance(value, int) and not isinstance(value, bool) and "bytes" in key:
            text = f"{value}  ({value / 2**20:.2f} MiB)"
        elif isinstance(value, float):
            text = f"{value:.6g}"
        else:
            text = "null" if value is None else str(value)
        lines.append(f"{key}: {text}")
    return "\n".join(lines)


def write_trace(path: str, result: SimResult) -> None:
    """The run's contract-v1 JSONL trace, written atomically."""
    with TraceWriter(path, result.header) as writer:
        for event in result.events:
            writer.write(event)


def write_json(path: str | Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1) + "\n")
