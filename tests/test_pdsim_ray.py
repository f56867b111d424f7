"""`pdsim sweep --ray`: rows equal to the process pool, clean cluster lifetime, bad addresses."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pdsim.cli import main

# Imported here, before any test runs: `import ray` sets RAY_CLIENT_MODE in os.environ for the
# rest of the process, a change no test made (conftest's no_leaks would name it).
with contextlib.suppress(ImportError):
    import ray  # noqa: F401

# Costly points first (16384 tokens, chunk 64, layer mode): batches finish out of grid order.
GRID = ["sweep", "--modes", "layer,chunk", "--prompts", "16384,512", "--chunks", "64,256,1024",
        "--max-pending", "1,2"]
HEAD = """
import logging, sys, ray
context = ray.init(num_cpus=2, _temp_dir=sys.argv[1], include_dashboard=False,
                   object_store_memory=128 * 2**20, logging_level=logging.ERROR,
                   log_to_driver=False)
print(context.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.fixture
def own_temp(monkeypatch):
    """A fresh, short temp folder for this test alone (TMPDIR and tempfile's): its Ray cluster's
    folders are made in it and its processes inherit TMPDIR naming it, so the test checks
    only what its own cluster made, whatever other Ray runs share the machine."""
    folder = tempfile.mkdtemp(prefix="pdr-")  # short: Ray's socket paths are <= 107 bytes
    monkeypatch.setenv("TMPDIR", folder)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _ray_processes(mark: Path) -> set[int]:
    """Live processes of Ray (its binaries, Python workers and agents, ray::...) that belong
    to the test owning folder `mark`: their command line or environment names it (a worker's
    command line is rewritten to ray::..., its environment keeps TMPDIR)."""
    found, needle = set(), str(mark).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            if not (b"/ray/" in cmdline or cmdline.startswith(b"ray::")):
                continue
            if needle in cmdline or needle in (entry / "environ").read_bytes():
                found.add(int(entry.name))
        except OSError:  # gone, or someone else's (no access to its environment)
            continue
    return found


def _no_ray_processes_left(mark: Path, wait_s: float = 5.0) -> set[int]:
    """This test's Ray processes still alive after up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while (left := _ray_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _outputs(tmp_path: Path, name: str, extra: list[str]) -> tuple[str, str]:
    csv, js = tmp_path / f"{name}.csv", tmp_path / f"{name}.json"
    assert main([*GRID, "--csv", str(csv), "--json", str(js), *extra]) == 0
    return csv.read_text(), js.read_text()


def _refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_local_ray_cluster_rows_equal_the_process_pool(tmp_path, capsys, own_temp):
    """--ray without an address: same CSV and JSON as the pool, a bar, no Ray left behind."""
    pool = _outputs(tmp_path, "pool", ["--quiet", "--jobs", "2"])
    capsys.readouterr()
    ray_rows = _outputs(tmp_path, "ray", ["--ray", "--jobs", "2"])
    out, err = capsys.readouterr()
    assert ray_rows == pool and pool[0].count("\n") == 1 + 2 * 2 * 3 * 2
    assert "best for prompt 16384" in out
    bar = err.replace("\r", "\n").strip().splitlines()
    assert bar and all("cfg" in line for line in bar) and "24/24" in bar[-1]
    assert not _no_ray_processes_left(own_temp)
    assert not list(own_temp.glob("pdsim-ray-*"))
    assert "RAY_AUTH_MODE" not in os.environ or os.environ["RAY_AUTH_MODE"] != "token"


def test_unreachable_address_is_one_line_exit_2(tmp_path, capsys):
    """A port where nothing listens is refused at once, in one line naming --ray."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    csv = tmp_path / "s.csv"
    err = _refused(capsys, [*GRID, "--ray", f"127.0.0.1:{port}", "--csv", str(csv)])
    assert "--ray" in err and f"127.0.0.1:{port}" in err and "refused" in err
    assert not csv.exists()


@pytest.mark.timeout(60)  # a refusal that never comes fails here, not a clock comparison
def test_silent_listener_is_refused_after_the_timeout(capsys):
    """Something that accepts connections but never answers as Ray: exit 2, not before
    --ray-timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # the kernel completes handshakes; nobody ever speaks
        start = time.monotonic()
        err = _refused(capsys, [*GRID, "--ray", f"127.0.0.1:{s.getsockname()[1]}",
                                "--ray-timeout", "1.5"])
        elapsed = time.monotonic() - start
    assert "--ray" in err and "1.5 s" in err and elapsed >= 1.5


@pytest.mark.parametrize("address, words", [
    ("nohost", "HOST:PORT"), ("ray://head:10001", "HOST:PORT"), ("head:0", "HOST:PORT"),
    ("head:70000", "HOST:PORT"),
])
def test_malformed_address_is_refused_by_the_parser(capsys, address, words):
    """An ADDRESS that is not HOST:PORT or auto is refused before anything starts."""
    err = _refused(capsys, [*GRID, "--ray", address])
    assert "--ray" in err and words in err


def test_timeout_must_be_positive(capsys):
    """--ray-timeout 0 is refused, not taken as 'no limit'."""
    err = _refused(capsys, [*GRID, "--ray", "--ray-timeout", "0"])
    assert "--ray-timeout" in err


def test_missing_ray_package_says_how_to_install(monkeypatch, capsys):
    """Without the ray package, --ray is one line naming the extra to install."""
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "pdsim.ray_sweep", raising=False)
    err = _refused(capsys, [*GRID, "--ray"])
    assert "--ray" in err and "pdhandoff[ray]" in err


def test_a_cluster_gets_the_packages_as_single_folders(monkeypatch):
    """Connecting by address ships pdsim and pdref as their source folders: Ray refuses a
    package whose `__path__` has two folders, as pdref's has while its compiled build is
    current (pdref/accel.py)."""
    import pdref
    import pdsim
    from pdsim import ray_sweep

    seen = {}
    monkeypatch.setattr(ray_sweep, "_probe", lambda address, timeout_s: 2)
    monkeypatch.setattr(ray_sweep.ray, "init", lambda **options: seen.update(options))
    monkeypatch.setattr(ray_sweep.ray, "shutdown", lambda: None)
    with ray_sweep._remote_cluster("127.0.0.1:6379", 1.0) as cpus:
        assert cpus == 2
    shipped = seen["runtime_env"]["py_modules"]
    assert shipped == [os.path.dirname(pdsim.__file__), os.path.dirname(pdref.__file__)]
    assert all(isinstance(p, str) and os.path.isfile(os.path.join(p, "__init__.py"))
               for p in shipped)


@pytest.mark.slow
def test_cluster_address_rows_equal_the_process_pool(tmp_path, own_temp):
    """A cluster started elsewhere, given by address (token auth): same rows; no token: refused."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_AUTH_MODE", None)
    temp = tempfile.TemporaryDirectory(prefix="pdsim-head-")  # Ray's sockets: <= 107 bytes
    head = subprocess.Popen([sys.executable, "-c", HEAD, temp.name], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = head.stdout.readline().strip()
        assert address, "the head did not start"
        csv = [tmp_path / f"{name}.csv" for name in ("pool", "ray")]
        sweep = [sys.executable, "-m", "pdsim", *GRID, "--quiet", "--csv"]  # (PATH-free)
        subprocess.run([*sweep, str(csv[0])], check=True, env=env, timeout=300)
        no_token = subprocess.run([*sweep, str(csv[1]), "--ray", address], env=env,
                                  capture_output=True, text=True, timeout=300)
        assert no_token.returncode == 2 and "RAY_AUTH_MODE=token" in no_token.stderr
        subprocess.run([*sweep, str(csv[1]), "--ray", address], check=True,
                       env=dict(env, RAY_AUTH_MODE="token"), timeout=300)
        assert csv[1].read_text() == csv[0].read_text()
    finally:
        head.communicate(timeout=60)
        temp.cleanup()
    assert not _no_ray_processes_left(own_temp, wait_s=10)


@pytest.mark.slow
def test_ctrl_c_while_the_local_cluster_starts_leaves_nothing(own_temp):
    """Ctrl-C during Ray's start: the command stops, and no Ray process or temp dir is left."""
    temp = own_temp
    sweep = subprocess.Popen(
        [sys.executable, "-m", "pdsim.cli", *GRID, "--quiet", "--ray"], stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a shell's & ignores it
    deadline = time.monotonic() + 30
    while not list(temp.glob("pdsim-ray-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # inside ray.init (2..10 s here); without the hold this left agents
    sweep.send_signal(signal.SIGINT)
    err = sweep.communicate(timeout=60)[1].decode()
    assert sweep.returncode != 0 and "KeyboardInterrupt" in err
    assert not _no_ray_processes_left(temp)
    assert not list(temp.glob("pdsim-ray-*"))


LOAD = ["sweep", "--hw", "h200", "--modes", "chunk", "--prompts", "1024", "--chunks",
        "128,512", "--requests", "400", "--rate", "30", "--output-tokens", "6", "--quiet"]


def test_workload_points_on_ray_equal_the_process_pool(tmp_path, own_temp):
    """--requests points (streamed workloads) on a local Ray cluster give the pool's rows
    but for each worker's own peak RSS, which every row reports."""
    rows = {}
    for name, extra in (("pool", ["--jobs", "2"]), ("ray", ["--ray", "--jobs", "2"])):
        path = tmp_path / f"{name}.json"
        assert main([*LOAD, "--json", str(path), *extra]) == 0
        rows[name] = json.loads(path.read_text())["rows"]
    assert len(rows["pool"]) == 2 and all(r["requests"] == 400 for r in rows["pool"])
    assert all(r["peak_rss_mb"] > 0 for r in rows["pool"] + rows["ray"])
    strip = [{k: v for k, v in r.items() if k != "peak_rss_mb"} for r in rows["pool"]]
    assert strip == [{k: v for k, v in r.items() if k != "peak_rss_mb"} for r in rows["ray"]]
    assert not _no_ray_processes_left(own_temp)
