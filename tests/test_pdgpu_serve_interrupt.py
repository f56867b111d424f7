"""Ctrl-C and SIGTERM at each stage of `pdgpu serve` (pdgpu/interrupt.py): exit 130 / 143,
one line on stderr (besides progress lines), no Python traceback or C++ frames, never 134,
no process left, and the trace legal (from the producers' start on, at least its header).
The live trace, the start-up window of a bare run and the HTTP server's stops:
test_pdgpu_serve_live.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from serve_helpers import processes, trace_ok

from pdgpu import interrupt, serve_cli
from pdgpu.cli import main

PDGPU = [sys.executable, "-m", "pdgpu"]
NOISE = ("Traceback", "frame #", "terminate called", "Exception raised from", "Fatal Python")


def _cut_short(stop: KeyboardInterrupt):
    """A command whose clean-up fails while it handles `stop` (as a thread stopped
    mid-start fails its join)."""
    def command(args):
        try:
            raise stop
        except KeyboardInterrupt:
            raise RuntimeError("cannot join thread before it is started") from None
    return command


def test_a_clean_up_cut_short_by_ctrl_c_is_still_the_interrupt(monkeypatch, capsys):
    """An error raised while handling Ctrl-C reads as the interrupt: 130, one line."""
    monkeypatch.setattr(serve_cli, "cmd_serve", _cut_short(KeyboardInterrupt()))
    assert main(["serve"]) == 130
    assert capsys.readouterr().err == "pdgpu: interrupted (Ctrl-C): every process stopped\n"


def test_sigterm_is_the_same_path_with_exit_143(monkeypatch, capsys):
    """interrupt.Terminated (the SIGTERM handler's) ends serve with 143 and its own line."""
    monkeypatch.setattr(serve_cli, "cmd_serve", _cut_short(interrupt.Terminated()))
    assert main(["serve"]) == 143
    assert capsys.readouterr().err.startswith("pdgpu: terminated (SIGTERM)")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_held_is_raised_once_the_block_ends(sig):
    """interrupt.held() (around a producer's start, whose pid is known only at its end): a
    signal inside the block is not raised there but as the block ends, by the handler from
    before, which is back in place."""
    previous = interrupt.install()
    reached = []
    try:
        with pytest.raises(KeyboardInterrupt) as raised, interrupt.held():
            signal.raise_signal(sig)
            reached.append("end of block")
        assert reached == ["end of block"]
        assert isinstance(raised.value, interrupt.Terminated) == (sig == signal.SIGTERM)
        assert signal.getsignal(sig) is interrupt._first_signal
    finally:
        interrupt.restore(previous)


def _group(pgid: int) -> list[int]:
    return [pid for pid, (_, group, _) in processes().items() if group == pgid]


def _wait_for(stage: str, proc, err_path) -> None:
    """Until the run reaches `stage`: starting (pdgpu's signal handlers in, torch loading),
    producers (their processes exist: rendezvous and handshake), serving (a progress line
    counts tokens)."""
    deadline = time.monotonic() + 240  # a bound for a loaded machine, not a measurement
    while time.monotonic() < deadline and proc.poll() is None:
        if stage == "starting" and _catches_sigterm(proc.pid):  # pdgpu's handler is in,
            return  # torch not yet loaded (before it, the interpreter itself is starting)
        if stage == "producers" and len(_group(proc.pid)) >= 4:  # forkserver, tracker, 2
            return
        if stage == "serving" and "tokens/s" in err_path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"the run never reached {stage}: {err_path.read_text()[-500:]}")


def _catches_sigterm(pid: int) -> bool:
    """pdgpu/interrupt.py's handlers are installed (the kernel's caught-signal mask)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def _gone(pgid: int) -> bool:
    """The forkserver ends once it sees its parent gone, after its own import at worst."""
    deadline = time.monotonic() + 60
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _group(pgid)


CASES = [("starting", signal.SIGINT, True), ("starting", signal.SIGTERM, False),
         ("producers", signal.SIGINT, True), ("producers", signal.SIGINT, False),
         ("producers", signal.SIGTERM, False), ("serving", signal.SIGINT, True),
         ("serving", signal.SIGINT, False), ("serving", signal.SIGTERM, False)]


@pytest.mark.slow
@pytest.mark.parametrize("stage,sig,group", CASES,
                         ids=[f"{s}-{g.name}-{'group' if p else 'main'}" for s, g, p in CASES])
def test_an_interrupt_at_each_stage_ends_in_one_line(tmp_path, stage, sig, group):
    """SIGINT to the group (a terminal's Ctrl-C) or to the main process, or SIGTERM: one
    line, 130 or 143, nothing left running, the trace (when written) legal."""
    trace, err_path = tmp_path / "t.jsonl", tmp_path / "err.txt"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [*PDGPU, "serve", "--producers", "2", "--requests", "5000", "--concurrency", "4",
             "--output-tokens", "64", "--prompt-range", "32:64", "--trace", str(trace),
             "--progress-every", "0.5"], stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True)
    try:
        _wait_for(stage, proc, err_path)
        (os.killpg if group else os.kill)(proc.pid, sig)
        code = proc.wait(timeout=60)
        assert _gone(proc.pid), f"left running: {_group(proc.pid)}"
    finally:
        if _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    text = err_path.read_text()
    said = [line for line in text.splitlines() if "requests done" not in line]
    word = "terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted (Ctrl-C)"
    assert code == (143 if sig == signal.SIGTERM else 130), text
    assert len(said) == 1 and said[0].startswith(f"pdgpu: {word}"), text
    assert not any(noise in text for noise in NOISE), text
    if stage != "starting":  # opened before the producers start: a header at least
        lines = trace.read_bytes().splitlines()
        trace_ok(lines)
        assert b'"header"' in lines[0]
    if stage == "serving":
        assert any(b'"abort"' in line for line in lines)
