"""pdgpu serve / generate command lines: bad input refused before any process starts,
unservable configurations refused at the handshake, Ctrl-C and roles on separate machines."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from serve_helpers import descendants, kill, processes, producers_alive, serve, trace_ok

from pdgpu.cli import main
from pdgpu.serve.transport_nixl import nixl_module

PDGPU = [sys.executable, "-m", "pdgpu"]


def _one_line_exit_2(capsys, argv) -> str:
    before = producers_alive()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pdgpu: error:"), err
    assert producers_alive() <= before  # nothing started, nothing left
    return err


@pytest.mark.parametrize(("args", "field"), [
    (["--producers", "0"], "--producers"),
    (["--producers", "-2"], "--producers"),
    (["--output-tokens", "0"], "--output-tokens"),
    (["--pool-pages", "3", "--prompt-range", "100:120"], "pool-pages"),
    (["--prompt-range", "9:3"], "prompt-range"),
    (["--prefix", "8", "--prompt-range", "16:32"], "prefix"),
    (["--prompts", "/nonexistent/prompts.jsonl"], "prompts"),
    (["--init-method", "http://x"], "init-method"),
    (["--role", "producer", "--rank", "0", "--world-size", "2",
      "--init-method", "tcp://127.0.0.1:1"], "rank"),
    (["--device", "cuda"], "device"),
    (["--fail-rate", "1.5"], "fail-rate"),
    (["--cancel-rate", "-0.1"], "cancel-rate"),
    (["--corrupt-rate", "nan", "--verify"], "corrupt-rate"),
    (["--stall-rate", "0.1"], "stall-rate"),  # without --span-timeout: never ends
    (["--corrupt-rate", "0.1", "--no-verify"], "corrupt-rate"),  # unchecked: wrong tokens
    (["--kv-lane", "tcp"], "--kv-lane"),
    (["--kv-lane", ""], "--kv-lane"),
    (["--span-timeout", "0"], "span-timeout"),
    (["--span-timeout", "-2"], "span-timeout"),
    (["--heartbeat-timeout", "inf"], "heartbeat-timeout"),
    (["--kill-producer", "2@1", "--producers", "2"], "kill-producer"),
    (["--kill-producer", "0@-1"], "kill-producer"),
    (["--kill-producer", "0"], "kill-producer"),
    (["--max-attempts", "0"], "--max-attempts"),
    (["--restart-producers", "--role", "decoder", "--rank", "0", "--world-size", "2",
      "--init-method", "tcp://127.0.0.1:1"], "restart-producers"),
    (["--model", "./no-such-model"], "model: ./no-such-model does not exist"),
    (["--cuda-graphs", "on"], "cuda-graphs: on needs the decoder on a CUDA device, got cpu"),
    (["--cuda-graphs", "yes"], "--cuda-graphs"),
])
def test_bad_input_is_one_line_exit_2(capsys, args, field):
    """Each bad field: one line naming it, exit 2, no process started."""
    err = _one_line_exit_2(capsys, ["serve", "--no-progress", *args])
    assert field in err


def test_token_outside_vocab_in_prompts_file(tmp_path, capsys):
    """A token id outside the vocabulary names the request and the rule."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"req": "a", "tokens": [1, 2, 256], "output_tokens": 2}) + "\n")
    err = _one_line_exit_2(capsys, ["serve", "--prompts", str(path)])
    assert "256" in err and "vocab=256" in err


def test_port_in_use_is_refused(capsys):
    """A rendezvous port another socket holds: one line, exit 2, no producer started."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        err = _one_line_exit_2(capsys, ["serve", "--init-method", f"tcp://127.0.0.1:{port}",
                                        "--connect-timeout", "5"])
    assert "init-method" in err and str(port) in err


def test_generate_refuses_out_of_vocab_and_prints_json(capsys):
    """generate: a bad token or CUDA graphs on a CPU is exit 2; --json prints the output
    token list."""
    _one_line_exit_2(capsys, ["generate", "--tokens", "1,999"])
    assert "cuda-graphs: on needs" in _one_line_exit_2(
        capsys, ["generate", "--tokens", "1", "--cuda-graphs", "on"])
    assert main(["generate", "--tokens", "5,6,7", "--output-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["output"]) == 3 and all(0 <= t < 256 for t in out["output"])


def test_generate_samples_with_a_seed_and_names_a_bad_option(capsys):
    """generate --temperature with --sample-seed repeats itself and is not the greedy
    output; an option out of range or min-tokens over output-tokens is one line, exit 2."""
    def run(*extra) -> list[int]:
        assert main(["generate", "--tokens", "5,6,7", "--output-tokens", "6", "--json",
                     *extra]) == 0
        return json.loads(capsys.readouterr().out)["output"]
    sampled = run("--temperature", "1.5", "--top-k", "50", "--sample-seed", "4")
    assert sampled == run("--temperature", "1.5", "--top-k", "50", "--sample-seed", "4")
    assert sampled != run()
    assert "top-p" in _one_line_exit_2(capsys, ["generate", "--tokens", "1", "--top-p", "0"])
    err = _one_line_exit_2(capsys, ["generate", "--tokens", "1", "--output-tokens", "2",
                                    "--min-tokens", "3"])
    assert "min-tokens" in err and "output-tokens (2)" in err


@pytest.mark.parametrize(("args", "word"), [
    (["--model", "qwen3-next-80b-a3b", "--mode", "layer"], "CFG-1"),
    (["--no-kv-progress", "--mode", "chunk"], "kv_progress"),
])
def test_handshake_refuses_unservable_runs(tmp_path, capsys, args, word):
    """Producers announce capabilities first; the run is refused before any reserve."""
    code, results, trace = serve(tmp_path, "--producers", "2", "--requests", "2", *args)
    assert code == 2 and not results and not trace
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and word in err


def test_whole_mode_without_kv_progress_serves(tmp_path):
    """A producer without kv_progress still serves whole mode."""
    code, results, trace = serve(tmp_path, "--no-kv-progress", "--mode", "whole",
                                 "--requests", "2", "--output-tokens", "2", "--verify")
    assert code == 0 and [r["status"] for r in results] == ["ok", "ok"]
    trace_ok(trace)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> list[int]:
    return [pid for pid, (_, group, _) in processes().items() if group == pgid]


@pytest.mark.slow
def test_ctrl_c_stops_every_process_and_closes_the_trace(tmp_path):
    """SIGINT to the process group mid-run: exit 130, one line, no process left, the trace
    complete (live requests aborted) and legal."""
    trace = tmp_path / "t.jsonl"
    proc = subprocess.Popen(
        [*PDGPU, "serve", "--producers", "2", "--requests", "5000", "--concurrency", "4",
         "--output-tokens", "64", "--prompt-range", "32:64", "--trace", str(trace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(descendants(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)  # forkserver + 2 producers
        time.sleep(4)  # handshake, models, serving
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130
        assert err.decode().strip().splitlines()[-1].startswith("pdgpu: interrupted")
        time.sleep(0.5)
        assert not _group_alive(proc.pid)
        lines = trace.read_bytes().splitlines()
        trace_ok(lines)
        assert any(b'"abort"' in line for line in lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill(_group_alive(proc.pid))


@pytest.mark.parametrize("lane", [
    "shm", pytest.param("nixl", marks=pytest.mark.skipif(
        nixl_module() is None, reason="nixl is not installed (pip install --no-deps nixl-cu13)"))])
def test_roles_on_separate_machines(tmp_path, lane):
    """Decoder and producers started on their own with --init-method/--rank/--world-size,
    KV over each lane every process asks for (nixl: the decoder READs from the producers)."""
    port, results = _free_port(), tmp_path / "r.jsonl"
    common = ["--init-method", f"tcp://127.0.0.1:{port}", "--world-size", "3",
              "--connect-timeout", "60", "--kv-lane", lane]
    decoder = subprocess.Popen(
        [*PDGPU, "serve", "--role", "decoder", "--rank", "0", *common, "--requests", "3",
         "--output-tokens", "3", "--results", str(results), "--verify", "--no-progress",
         "--trace", str(tmp_path / "t.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    procs = [decoder] + [subprocess.Popen(
        [*PDGPU, "serve", "--role", "producer", "--rank", str(r), *common],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        for r in (1, 2)]
    try:
        codes = [p.wait(timeout=120) for p in procs]
        assert codes == [0, 0, 0], [p.stderr.read().decode()[-500:] for p in procs]
        lines = [json.loads(x) for x in results.read_text().splitlines()]
        assert [x["status"] for x in lines] == ["ok"] * 3
        assert json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])["transport"] \
            == lane
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_decoder_leaves_no_orphan(tmp_path):
    """SIGKILL of the decoder alone (no cleanup runs): its producers and forkserver notice the
    broken link and exit within seconds."""
    proc = subprocess.Popen(
        [*PDGPU, "serve", "--producers", "2", "--requests", "5000", "--concurrency", "4",
         "--output-tokens", "64", "--prompt-range", "32:64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(descendants(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(proc.pid)
    finally:
        kill(_group_alive(proc.pid))
