"""Shared by the pdgpu serve tests: runs in this process (the forkserver that forks the
producers stays warm between tests), process accounting, a context-sensitive checkpoint."""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pdgpu.checkpoint import save_checkpoint
from pdgpu.cli import main
from pdgpu.generate import generate
from pdgpu.model import build_model
from pdgpu.sampling import GREEDY, Sampling
from pdgpu.serve import launch
from pdgpu.serve.models import load_served_model
from pdgpu.serve.transport_shm import SHM_DIR
from pdref.check import check_lines
from pdref.models import load_model


def processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, command line) of every process on the machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":  # a zombie is already dead
            out[int(entry.name)] = (int(fields[1]), int(fields[2]), cmd)
    return out


def descendants(root: int) -> set[int]:
    """Every live process below `root`."""
    table = processes()
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def forkserver_pid() -> int | None:
    import multiprocessing.forkserver as fs
    return fs._forkserver._forkserver_pid


def producers_alive() -> set[int]:
    """Producer processes forked for this test process (children of its forkserver)."""
    server = forkserver_pid()
    return descendants(server) if server else set()


def kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def shm_segments() -> list[str]:
    """Shared-memory KV segments of links this process reads (transport_shm.py) still in
    /dev/shm: none once a run ended, however its producers ended."""
    return sorted(p.name for p in SHM_DIR.glob(f"pdgpu-kv-{os.getpid()}-*"))


def serve(tmp_path: Path, *args: str) -> tuple[int, list[dict], list[bytes]]:
    """`pdgpu serve ARGS` in this process: (exit code, results lines, trace lines). Asserts
    that no producer outlives the run (killing any that does) and that no shared-memory
    segment of its links is left."""
    results, trace = tmp_path / "results.jsonl", tmp_path / "trace.jsonl"
    try:
        code = main(["serve", "--results", str(results), "--trace", str(trace),
                     "--no-progress", "--connect-timeout", "60", *args])
    finally:
        left = producers_alive()
        kill(left)
    assert not left, f"producer processes left behind: {left}"
    assert not shm_segments(), f"shared-memory segments left behind: {shm_segments()}"
    lines = [json.loads(x) for x in results.read_text().splitlines()] if results.exists() else []
    events = trace.read_bytes().splitlines() if trace.exists() else []
    return code, lines, events


def trace_ok(lines: list[bytes]) -> None:
    verdict = check_lines(lines, "trace")
    assert verdict.ok, (verdict.code, verdict.line, verdict.message)


def events_of(lines: list[bytes], kind: str) -> list[dict]:
    return [e for e in map(json.loads, lines[1:]) if e["kind"] == kind]


def write_sensitive_checkpoint(folder: Path) -> Path:
    """A tiny Qwen3 in Hugging Face layout whose weights are large enough that every output
    token depends on the whole context (at the presets' 0.02 init it echoes its input)."""
    model = build_model(load_model("tiny"), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(8)
    save_checkpoint(model, folder)
    return folder


def reference(model_arg: str, tokens, output_tokens: int, chunk: int, prefix: int,
              seed: int = 0, eos: int | None = None, device: str = "cpu",
              sampling: Sampling = GREEDY) -> list[int]:
    """`pdgpu generate`'s tokens (the same function), one thread like the serving ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_served_model(model_arg, seed, None, device)
        return generate(model, list(tokens), output_tokens, chunk, prefix, eos=eos,
                        sampling=sampling)
    finally:
        torch.set_num_threads(threads)


def drawn_prompts(path: Path, count: int, lengths, vocab: int, prefix: int, out: int,
                  seed: int = 0) -> list[dict]:
    """Write a prompts file with a shared prefix; its lines."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (prefix,), generator=gen).tolist()
    lines = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        tokens = shared + torch.randint(0, vocab, (n - prefix,), generator=gen).tolist()
        lines.append({"req": f"q{i}", "tokens": tokens, "output_tokens": out})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def watch_decoder(monkeypatch) -> dict:
    """The next in-process run's Decoder: box["decoder"], once box["event"] is set (its
    serving loop started)."""
    box = {"event": threading.Event()}

    class Watched(launch.Decoder):
        def run(self):
            box["decoder"] = self
            box["event"].set()
            super().run()

    monkeypatch.setattr(launch, "Decoder", Watched)
    return box


def linked_pair(make, join_s: float) -> list:
    """Two transports of this process, `make(store, rank)` for ranks 0 and 1, joined by one
    link (rank 1 connects to rank 0; its join waited on for at most `join_s`)."""
    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=20),
                           wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, 2, is_master=False,
                           timeout=timedelta(seconds=20), wait_for_workers=False)
    ends = [make(store, rank) for rank, store in enumerate((master, client))]
    joiner = threading.Thread(target=ends[1].connect, args=(0, 0))
    joiner.start()
    ends[0].connect(1, 0)
    joiner.join(timeout=join_s)
    return ends


def close_ends(ends) -> None:
    """Close transports at once (nothing left to wait for), flushing for a second at most."""
    for end in ends:
        end.close(wait_s=0.0, flush_s=1.0)
