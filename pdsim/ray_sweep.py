"""`pdsim sweep --ray [ADDRESS]`: the sweep's grid points as Ray tasks, rows in grid order.

Without an address this command starts a private local cluster (its CPUs = `--jobs`, a small
object store, its temp dir and logs in a fresh folder) and shuts it down and removes the
folder before returning, also on an error or Ctrl-C. With an address (`HOST:PORT` of a
cluster's head, or `auto`) the cluster must answer a probe within `--ray-timeout` seconds,
else the command refuses it in one line; the probe runs in a child process because Ray's own
connect retries for minutes and writes its retries to stderr. The driver ships its own pdsim
and pdref to the workers, so every node runs the code whose rows the process pool would give.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import ray
from tqdm import tqdm

import pdref
import pdsim
from pdsim.core.config import SimConfig
from pdsim.options import UsageError
from pdsim.sweep_point import Point, evaluate

OBJECT_STORE_BYTES = 128 * 2**20  # rows are a few hundred bytes; Ray's default is 30% of RAM
TCP_TIMEOUT_S = 5.0  # a head that does not accept a connection by then is unreachable
BATCHES_PER_CPU = 8  # small batches keep the bar moving and the CPUs evenly loaded
QUIET = dict(logging_level=logging.ERROR, log_to_driver=False)
PROBE = """
import logging, sys, ray
ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
print(int(ray.cluster_resources().get("CPU", 0)))
ray.shutdown()
"""


def run_on_ray(base: SimConfig, points: list[Point], prefix: int, address: str | None,
               jobs: int, timeout_s: float, progress: bool = True, load=None) -> list[dict]:
    """Every point's metrics, in grid order, on a Ray cluster (a private local one if None);
    `load`: each point's workload (sweep_load.Load), drawn and run streamed in its worker."""
    cluster = _local_cluster(jobs) if address is None else _remote_cluster(address, timeout_s)
    with _restored_environment(), cluster as cpus:
        return _rows(base, points, prefix, cpus, progress, load)


@contextlib.contextmanager
def _restored_environment() -> Iterator[None]:
    """Ray's settings for this command only: ray.init sets variables of os.environ
    (RAY_AUTH_MODE, RAY_CLIENT_MODE, PYTHONBREAKPOINT) and a SIGTERM handler, and
    ray.shutdown undoes neither; a caller in the same process gets its own back."""
    saved = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a sweep reports nothing anywhere
    try:
        yield
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def _local_cluster(cpus: int) -> Iterator[int]:
    with tempfile.TemporaryDirectory(prefix="pdsim-ray-", ignore_cleanup_errors=True) as temp:
        try:
            with _interrupt_after_start():
                _init("could not start a local Ray cluster", num_cpus=cpus, _temp_dir=temp,
                      object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False)
            yield cpus
        finally:
            ray.shutdown()


@contextlib.contextmanager
def _interrupt_after_start() -> Iterator[None]:
    """Hold a first Ctrl-C until ray.init returns: interrupted half way, it leaves processes
    that ray.shutdown does not know (seen: its agents outlived the command); a second one
    interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _remote_cluster(address: str, timeout_s: float) -> Iterator[int]:
    cpus = _probe(address, timeout_s)
    _init(f"cannot connect to a Ray cluster at {address}", address=address,
          runtime_env={"py_modules": [_source_dir(pdsim), _source_dir(pdref)]})
    try:
        yield cpus
    finally:
        ray.shutdown()


def _source_dir(package) -> str:
    """The package's own folder, which Ray ships to the cluster's nodes as is. Not the module:
    with this host's compiled build current, its `__path__` has two folders (pdref/accel.py),
    which Ray refuses; the nodes run the Python sources, which compute the same."""
    return os.path.dirname(package.__file__)


def _init(failure: str, **options) -> None:
    try:
        ray.init(**options, **QUIET)
    except Exception as e:  # Ray raises many kinds; the command says what failed in one line
        ray.shutdown()
        raise UsageError(f"--ray: {failure}: {_first_line(e)}") from e


def _probe(address: str, timeout_s: float) -> int:
    """The cluster's CPU count; a UsageError naming --ray if it does not answer in time."""
    if address != "auto":
        _check_tcp(address)
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, address], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise UsageError(f"--ray: no Ray cluster answered at {address} within "
                         f"--ray-timeout={timeout_s:g} s") from None
    if done.returncode != 0:
        raise UsageError(f"--ray: cannot connect to a Ray cluster at {address}: "
                         f"{_probe_error(done.stderr)}")
    cpus = int(done.stdout.split()[-1])
    if cpus < 1:
        raise UsageError(f"--ray: the Ray cluster at {address} has no CPUs")
    return cpus


def _check_tcp(address: str) -> None:
    host, _, port = address.rpartition(":")  # checked by the parser: HOST:PORT
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=TCP_TIMEOUT_S).close()
    except OSError as e:
        reason = "timed out" if isinstance(e, TimeoutError) else e.strerror or str(e)
        raise UsageError(f"--ray: cannot reach a Ray cluster at {address}: {reason}") from None


def _rows(base: SimConfig, points: list[Point], prefix: int, cpus: int,
          progress: bool, load=None) -> list[dict]:
    size = max(1, math.ceil(len(points) / (cpus * BATCHES_PER_CPU)))
    batches = [points[i:i + size] for i in range(0, len(points), size)]
    task, base_ref = ray.remote(_evaluate_batch), ray.put(base)
    pending = {task.remote(base_ref, batch, prefix, load): i for i, batch in enumerate(batches)}
    done: list[list[dict] | None] = [None] * len(batches)
    with tqdm(total=len(points), disable=not progress, unit="cfg", file=sys.stderr) as bar:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(ready[0])
            done[index] = ray.get(ready[0])
            bar.update(len(batches[index]))
    return [row for batch in done for row in batch]


def _evaluate_batch(base: SimConfig, points: list[Point], prefix: int, load=None) -> list[dict]:
    return [evaluate(base, point, prefix, load) for point in points]


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _probe_error(stderr: str) -> str:
    """The probe's failure in one line; a missing token says how Ray wants it given."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if any("AuthenticationError" in line for line in lines):
        return ("the cluster refused this driver's token: export RAY_AUTH_MODE=token and the "
                "cluster's token (RAY_AUTH_TOKEN, or the file ~/.ray/auth_token)")
    return lines[-1] if lines else "the probe exited without a message"
