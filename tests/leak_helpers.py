"""What a test left running: the threads and processes it started that are still alive after a
short grace (conftest.py's autouse fixture fails the test on them). A thread is compared as an
object, not by ident (an ident is reused once its thread ends); a process is any descendant of
this one, found through /proc's per-thread `children` lists (a few small reads, not a scan of
every process on the machine)."""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
import time
from pathlib import Path

PROC_CHILDREN = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()
GRACE_S = 3.0  # most a test's teardown waits, in all, for what it started to end by itself

# Threads that live as long as the process, started lazily once by a library (measured over
# the default suite: every other thread a test starts ends with it):
LIFELONG_THREADS = frozenset({
    # tqdm's monitor: the first bar made (even a disabled one) starts it, and tqdm 4.70 never
    # stops it before the process exits (its _decr_instances no longer ends it)
    "tqdm_monitor",
})


def descendants(root: int | None = None) -> set[int]:
    """Every process below `root` (this process by default), zombies included."""
    children = _children if PROC_CHILDREN else _children_by_scan()
    found, frontier = set(), [root or os.getpid()]
    while frontier:
        new = children(frontier.pop()) - found
        found |= new
        frontier.extend(new)
    return found


def _children(pid: int) -> set[int]:
    kids = set()
    for task in _listdir(f"/proc/{pid}/task"):
        try:
            kids.update(map(int, Path(f"/proc/{pid}/task/{task}/children").read_text().split()))
        except OSError:  # the task or the process ended meanwhile
            continue
    return kids


def _children_by_scan():
    """For a kernel without the `children` lists: every process's parent, read once."""
    parents: dict[int, set[int]] = {}
    for entry in _listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat:
            parents.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), set()).add(
                int(entry))
    return lambda pid: parents.get(pid, set())


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """Running (a zombie has ended; only its exit status is left to collect)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _lifelong_processes() -> set[int]:
    """multiprocessing's forkserver and resource tracker: each started once, on first use, and
    kept for the rest of the process (the serve tests' producers fork from the warm server)."""
    pids = {multiprocessing.forkserver._forkserver._forkserver_pid,
            multiprocessing.resource_tracker._resource_tracker._pid}
    return {p for p in pids if p}


def snapshot() -> tuple[set[threading.Thread], set[int]]:
    """The live threads and descendant processes now."""
    return set(threading.enumerate()), descendants()


def leaks(before: tuple[set[threading.Thread], set[int]], grace_s: float = GRACE_S) -> list[str]:
    """What started since `before` and is still alive after waiting `grace_s` in all."""
    deadline = time.monotonic() + grace_s
    threads = [t for t in threading.enumerate() if t not in before[0]
               and t.name not in LIFELONG_THREADS
               # a thread started outside Python (a C library's): not ours to join or stop
               and not isinstance(t, threading._DummyThread)]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    pids = descendants() - before[1] - _lifelong_processes()
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.01)
    left = [f"thread {t.name!r}" for t in threads if t.is_alive()]
    return left + [f"process {p} ({_command(p)})" for p in sorted(pids) if _alive(p)]


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "ended"


# Not a test's change: pytest's own variable naming the test and its phase, and one torch sets
# on a first use inside itself and keeps for the process (inductor's cache folder, the same
# value every time; which test makes that first use depends on the order tests run in).
NOT_CHANGES = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


def process_state() -> dict:
    """What a test must give back as it found it: the environment, the working directory,
    the SIGINT and SIGTERM handlers and, once torch is loaded, its thread count and default
    dtype (`torch.set_num_threads(1)` left behind slows every later test)."""
    environment = {k: v for k, v in os.environ.items() if k not in NOT_CHANGES}
    state = {"environment": environment, "working directory": os.getcwd(),
             "SIGINT handler": signal.getsignal(signal.SIGINT),
             "SIGTERM handler": signal.getsignal(signal.SIGTERM)}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):  # (not while it imports)
        state["torch threads"] = torch.get_num_threads()
        state["torch default dtype"] = torch.get_default_dtype()
    return state


def changed_state(before: dict) -> list[str]:
    """What differs from `before` (a key first seen now, e.g. torch loaded by the test, is
    not a change)."""
    after, changes = process_state(), []
    for key, was in before.items():
        now = after[key]
        if key == "environment":
            changes += [f"${name} {was.get(name)!r} -> {now.get(name)!r}"
                        for name in sorted(set(was) | set(now)) if was.get(name) != now.get(name)]
        elif now != was:
            changes.append(f"{key} {was!r} -> {now!r}")
    return changes
