"""The real engine, run as a subprocess (`python -m pdgpu compare`): pdsim never imports pdgpu.

One `EnginePoint` is one engine configuration; `run_point` runs every mode of it on one prompt
(`--requests R` back to back, whole first: the parity baseline), writes one trace per mode,
and reads back per-mode measurements: the median over the trace's request lives of handoff,
tail and prefill (each life timed from its own `reserve`), plus the trace's peak staging.
With several lives the first is left out, as `pdsim calibrate` does. The engine warms its own
buffers before t = 0 and keeps freed memory (`pdgpu.host`), so that first life is no longer
2-5x slow on its copies, but it alone runs right after the warm-up's single chunk.
An `ExportPoint` is one export-only run (`pdgpu run --no-compute --payload BYTES`, one mode):
a payload handed off with no prefill, checked byte-exact by the engine (a mismatch exits 1).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import attrs

from pdref.metrics import life_metrics
from pdref.trace import read_trace
from pdsim.fit import EngineRunError


@attrs.frozen
class EnginePoint:
    """One engine configuration (every mode of it runs on the same prompt)."""

    prompt: int
    chunk: int
    max_pending: int = 2
    prefix: int = 0
    link_gbps: float | None = None

    no_compute = False  # a prefill runs (ExportPoint: none)

    @property
    def name(self) -> str:
        link = f"-link{self.link_gbps:g}" if self.link_gbps else ""
        return f"p{self.prompt}-c{self.chunk}-m{self.max_pending}-x{self.prefix}{link}"

    def prompt_tokens(self, bytes_per_token: int) -> int:
        return self.prompt


@attrs.frozen
class ExportPoint:
    """One export-only engine configuration: `payload` bytes handed off in `mode`."""

    payload: int
    mode: str
    chunk: int
    max_pending: int = 2
    link_gbps: float | None = None
    prefix = 0
    no_compute = True

    @property
    def name(self) -> str:
        link = f"-link{self.link_gbps:g}" if self.link_gbps else ""
        return f"export{self.payload}-{self.mode}-c{self.chunk}-m{self.max_pending}{link}"

    def prompt_tokens(self, bytes_per_token: int) -> int:
        """The prompt the payload fills (rounded up to whole tokens, as both shells do)."""
        return -(-self.payload // bytes_per_token)


@attrs.frozen
class Measured:
    """One mode of one point as the engine ran it."""

    mode: str
    trace: str
    handoff_s: float
    tail_s: float
    prefill_s: float
    peak_staging_bytes: int
    first_token: int | None
    parity: bool


def pacing_and_device(link_gbps: float | None, device: str | None) -> list[str]:
    """The engine options every run passes only when set: link pacing and device."""
    return ((["--link-gbps", repr(link_gbps)] if link_gbps else [])
            + (["--device", device] if device else []))


def engine_failed(proc: subprocess.CompletedProcess, what: str) -> EngineRunError:
    """An engine subprocess that failed, in one line: its exit code and last stderr line."""
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return EngineRunError(f"{what}: exit {proc.returncode}: {last}")


def engine_argv(point: EnginePoint, model: str, trace_dir: Path, requests: int,
                device: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "pdgpu", "compare", "--model", model,
            "--prompt", str(point.prompt), "--chunk", str(point.chunk),
            "--max-pending", str(point.max_pending), "--prefix", str(point.prefix),
            "--requests", str(requests), "--trace-dir", str(trace_dir), "--json"]
    return argv + pacing_and_device(point.link_gbps, device)


def run_point(point: EnginePoint, model: str, trace_dir: Path, requests: int = 2,
              device: str | None = None) -> list[Measured]:
    """Run the engine on one point; one Measured per mode (whole, chunk, layer)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(engine_argv(point, model, trace_dir, requests, device),
                          capture_output=True, text=True)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise engine_failed(proc, f"engine on {point.name}")
    summary = json.loads(proc.stdout)
    return [measure(trace_dir / f"{mode}.jsonl", mode, entry)
            for mode, entry in summary.items()]


def export_argv(point: ExportPoint, model: str, trace: Path, requests: int,
                device: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "pdgpu", "run", "--model", model, "--no-compute",
            "--payload", str(point.payload), "--mode", point.mode, "--chunk", str(point.chunk),
            "--max-pending", str(point.max_pending), "--requests", str(requests),
            "--trace", str(trace), "--json"]
    return argv + pacing_and_device(point.link_gbps, device)


def run_export(point: ExportPoint, model: str, trace_dir: Path, requests: int = 2,
               device: str | None = None) -> Measured:
    """Run one export-only configuration; its Measured (parity: the payload landed exact)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace = trace_dir / f"{point.mode}.jsonl"
    proc = subprocess.run(export_argv(point, model, trace, requests, device),
                          capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise engine_failed(proc, f"engine on {point.name}")
    entry = {"metrics": json.loads(proc.stdout), "parity": {"kv_equal": True,
                                                            "token_equal": True}}
    return measure(trace, point.mode, entry)


def measure(trace: Path, mode: str, entry: dict) -> Measured:
    """Median per-life timings of one engine trace, with the compare's parity verdict."""
    events = [item for _, item in list(read_trace(trace))[1:]]
    lives, peak = life_metrics(events)
    done = [life for life in lives if life.ready_t is not None and life.outcome == "released"]
    if len(done) > 1:  # the first is the engine's warm-up
        peak = peak_staging(events, skip=done[0].req)
        done = done[1:]
    if not done:
        raise EngineRunError(f"{trace}: no request life was admitted")
    parity = entry.get("parity", {})
    return Measured(
        mode=mode, trace=str(trace),
        handoff_s=statistics.median(life.ready_t - life.reserve_t for life in done),
        tail_s=statistics.median(life.ready_t - life.produced_t for life in done),
        prefill_s=statistics.median(life.produced_t - life.reserve_t for life in done),
        peak_staging_bytes=peak, first_token=entry["metrics"].get("first_token"),
        parity=bool(parity.get("kv_equal")) and bool(parity.get("token_equal")))


def peak_staging(events, skip: str) -> int:
    """The most bytes in flight at once, spans of request `skip` left out."""
    flying: dict = {}  # span -> (req, bytes)
    peak = 0
    for e in events:
        if e.kind == "issue" and e.req != skip:
            flying[e.span] = (e.req, e.bytes)
            peak = max(peak, sum(n for _, n in flying.values()))
        elif e.kind in ("land", "fail"):
            flying.pop(e.span, None)
        elif e.kind == "abort":  # its spans in flight are cancelled
            flying = {k: v for k, v in flying.items() if v[0] != e.req}
    return peak
