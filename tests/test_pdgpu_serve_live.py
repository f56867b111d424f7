"""`pdgpu serve` as a user runs it (a process of its own): its trace and `--results` can be
read while it runs (whole lines, legal under `pdref check --open`), and a stop at any moment
(in the start-up window, while serving, batch or HTTP) closes them legal, exits 130/143 with
one line and leaves no process behind, the forkserver included."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from serve_helpers import processes
from wait_helpers import wait_until

from pdref.check import check_file

PDGPU = [sys.executable, "-m", "pdgpu"]


def _group(pgid: int) -> list[int]:
    return [pid for pid, (_, group, _) in processes().items() if group == pgid]


class Run:
    """`pdgpu serve ARGS --trace --results` in a session of its own, stderr to a file."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.trace, self.results, self.err = tmp / "t.jsonl", tmp / "r.jsonl", tmp / "err.txt"
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [*PDGPU, "serve", "--model", "tiny", "--producers", "1", "--no-progress",
                 "--trace", str(self.trace), "--results", str(self.results), *args],
                stdout=subprocess.PIPE, stderr=err, start_new_session=True)

    def lines(self, kind: str) -> int:
        """Whole lines of `kind` in the trace now."""
        text = self.trace.read_bytes() if self.trace.exists() else b""
        return sum(f'"kind":"{kind}"'.encode() in line for line in text.split(b"\n")[1:])

    def stop(self, sig: int) -> tuple[int, list[str]]:
        """`sig` to the main process; its exit code and stderr lines. Asserts that no
        process of its session is left the moment it has exited."""
        self.proc.send_signal(sig)
        try:
            self.proc.communicate(timeout=120)
            left = _group(self.proc.pid)
            assert not left, f"left running after the exit: {left}"
        finally:
            if _group(self.proc.pid):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode, self.err.read_text().splitlines()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _closed_legal(path: Path) -> None:
    verdict = check_file(path)
    assert verdict.ok, (verdict.code, verdict.line, verdict.message)


def test_a_running_batch_serve_is_readable_and_ctrl_c_closes_it(tmp_path):
    """While requests arrive (rate 2/s over ~100 s) the trace under its name holds released
    requests and is legal under --open, `--results` has their lines; Ctrl-C then: exit 130,
    one line, the trace legal as a complete trace, every request's line in workload order."""
    run = Run(tmp_path, "--requests", "200", "--rate", "2", "--output-tokens", "8",
              "--prompt-range", "32:64")
    try:
        wait_until(lambda: run.lines("release") >= 2 or run.proc.poll() is not None,
                   "two requests released in the live trace")
        verdict = check_file(run.trace, open_trace=True)
        results = [json.loads(x) for x in run.results.read_text().splitlines()]
        assert run.proc.poll() is None, "the run ended before it could be read"
        assert verdict.ok and verdict.requests >= 2, verdict
        assert len(results) >= 1 and {r["status"] for r in results} == {"ok"}
        code, err = run.stop(signal.SIGINT)
    finally:
        run.kill()
    assert code == 130 and len(err) == 1 and err[0].startswith("pdgpu: interrupted"), err
    _closed_legal(run.trace)
    results = [json.loads(x) for x in run.results.read_text().splitlines()]
    assert [r["req"] for r in results] == [f"r{i}" for i in range(200)]
    assert {r["status"] for r in results} <= {"ok", "cancelled"}


START_UP = [("batch", signal.SIGINT),
            pytest.param("batch", signal.SIGTERM, marks=pytest.mark.slow),
            ("http", signal.SIGINT)]


@pytest.mark.parametrize(("kind", "sig"), START_UP)
def test_a_stop_in_the_start_up_window_leaves_a_legal_trace(tmp_path, kind, sig):
    """A signal once the trace exists but before any request was served (producers start,
    handshake), batch or `--http`: 130/143, its line last on stderr, the trace its header
    alone (legal), the results file empty, no process left."""
    if kind == "http":
        pytest.importorskip("fastapi")
    args = ("--http", "127.0.0.1:0", "--http-max-prompt", "32") if kind == "http" else \
        ("--requests", "4", "--output-tokens", "4", "--prompt-range", "32:64")
    run = Run(tmp_path, *args)
    try:
        wait_until(lambda: run.trace.exists() or run.proc.poll() is not None,
                   "the trace opened")
        code, err = run.stop(sig)
    finally:
        run.kill()
    assert code == (143 if sig == signal.SIGTERM else 130), err
    assert "every process stopped" in err[-1] and not any("Traceback" in x for x in err), err
    assert len(err) == 1 or kind == "http", err  # http: its address line first, maybe a drain
    _closed_legal(run.trace)
    lines = run.trace.read_bytes().splitlines()
    assert json.loads(lines[0])["kind"] == "header" and len(lines) == 1, lines[:3]
    assert run.results.read_text() == ""


@pytest.mark.parametrize("sig", [signal.SIGINT,  # SIGTERM's 143: test_pdgpu_http.py too
                                 pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_an_http_server_is_readable_while_it_serves_and_a_signal_drains_it(tmp_path, sig):
    """`--http`: after a request the live trace holds its release (legal under --open) and
    `--results` its line; a signal drains: exit 130 (SIGINT) or 143 (SIGTERM), the trace
    closed legal, no process left."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    run = Run(tmp_path, "--http", "127.0.0.1:0", "--http-max-prompt", "32")
    try:
        port = _port(run)
        with httpx.Client() as http:  # one client: a new one loads the CA bundle each poll
            wait_until(lambda: _healthy(httpx, http, port), "the server serves")
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                            json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3})
        assert answer.status_code == 200
        wait_until(lambda: run.lines("release") >= 1, "the request's release in the trace")
        verdict = check_file(run.trace, open_trace=True)
        assert verdict.ok and verdict.requests == 1, verdict
        assert json.loads(run.results.read_text())["status"] == "ok"
        code, err = run.stop(sig)
    finally:
        run.kill()
    assert code == (143 if sig == signal.SIGTERM else 130), err
    _closed_legal(run.trace)


def _port(run: Run) -> int:
    found = []

    def listening() -> bool:
        found.extend(re.findall(r"http://127\.0\.0\.1:(\d+)/v1", run.err.read_text()))
        assert run.proc.poll() is None, run.err.read_text()
        return bool(found)
    wait_until(listening, "the server listens")
    return int(found[0])


def _healthy(httpx, http, port: int) -> bool:
    try:
        return http.get(f"http://127.0.0.1:{port}/health").status_code == 200
    except httpx.HTTPError:
        return False
