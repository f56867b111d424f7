"""Writing results: metrics as text or JSON, traces and files atomically.

Per-request results of a `pdsim run` (`--results FILE.jsonl`, the serving-run format of
specs/contract.md): one line per request, `{"req", "status", "output", "ttft_s", "e2e_s",
"attempts"}` plus `reason` when it did not end ok. The simulator generates no tokens:
`output` is null. TTFT runs from arrival (closed loop: from entering) to the first token of
its ok life (`produced`: the producer makes it), as pdgpu serve's; e2e from arrival to its
release, or to the moment it was cancelled or failed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pdref.cli_format import format_metrics
from pdref.metrics import life_metrics
from pdref.outfile import create_beside, write_atomic
from pdref.trace import TraceWriter
from pdsim.core.sim import SimResult

__all__ = ["ResultsStream", "format_metrics", "request_results", "write_atomic", "write_json",
           "write_results", "write_trace"]


def write_trace(path: str, result: SimResult) -> None:
    """The run's contract-v1 JSONL trace, written atomically."""
    with TraceWriter(path, result.header) as writer:
        for event in result.trace_events():
            writer.write(event)


def write_json(path: str | Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1) + "\n")


def request_results(result: SimResult) -> list[dict]:
    """One dict per request, in workload order."""
    lives, _ = life_metrics(result.events)
    ok = {life.req: life for life in lives if life.outcome == "released"}
    count: dict[str, int] = {}
    for life in lives:
        count[life.req] = count.get(life.req, 0) + 1
    outcomes = {o.req: o for o in result.outcomes}
    rows = []
    for request in result.requests:
        outcome, life = outcomes.get(request.req), ok.get(request.req)
        row = {"req": request.req, "status": "ok" if outcome is None else str(outcome.status),
               "output": None,
               "ttft_s": None if life is None
               else result.decode.tokens[request.req][0] - request.arrival,
               "e2e_s": (life.end_t if outcome is None else outcome.t) - request.arrival,
               "attempts": count.get(request.req, 0)}
        if outcome is not None and outcome.reason is not None:
            row["reason"] = outcome.reason
        rows.append(row)
    return rows


def write_results(path: str, result: SimResult) -> None:
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in request_results(result)))


class ResultsStream:
    """`--results` of a streamed run (a workload without faults: every request ends ok, in
    one life): a row written as each request ends, in that order, to a temporary file
    renamed into place when the run ends well (`with`); removed when it does not."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd, self.tmp = create_beside(path)
        self.file = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, life, arrival: float, first_token: float) -> None:
        """The row of a request that ended ok (`request_results`' fields)."""
        self.file.write(json.dumps({"req": life.req, "status": "ok", "output": None,
                                    "ttft_s": first_token - arrival,
                                    "e2e_s": life.end_t - arrival, "attempts": 1}) + "\n")

    def __enter__(self) -> ResultsStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.file.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)


def edge_note(chunk: int, chunks, fixed: bool = False) -> str:
    """A warning when the best chunk is the smallest or largest swept: the sweep cannot say
    whether a chunk beyond it is better still. `fixed`: the range is not the reader's to
    widen (the demo's own): said as a fact of that range, not as advice."""
    chunks = sorted(chunks)
    if len(chunks) < 2 or chunks[0] < chunk < chunks[-1]:
        return ""
    if fixed:
        return (f" (the edge of the range swept here, {chunks[0]}..{chunks[-1]}: a chunk "
                "beyond it may do better)")
    return f" (best is the edge of the range {chunks[0]}..{chunks[-1]}: widen it)"


def labels_title(labels: dict) -> str:
    """A run's labels as a title: "qwen3-0.6b on a100-pcie under production (link
    pcie-gen4), bandwidth x2"."""
    rest = {k: v for k, v in labels.items() if k not in ("model", "hw", "engine", "link")}
    head = f"{labels.get('model', '?')} on {labels.get('hw', '?')}"
    if "engine" in labels:
        head += f" under {labels['engine']}"
    if "link" in labels:
        head += f" (link {labels['link']})"
    extra = [f"bandwidth x{v:g}" if k == "bandwidth_scale" else f"{k} {v}"
             for k, v in rest.items()]
    return ", ".join([head, *extra])
