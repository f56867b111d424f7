"""Other work on the host during an engine run (pdsim/fit/host_load.py): what is counted as
the run's and what as others', the serving window, and a real busy process seen."""

import subprocess
import sys
import time

import pytest

from pdsim.fit import host_load as hl

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_tree_is_the_root_and_every_descendant():
    """A process tree: the root, its children and theirs; not its parent or siblings."""
    table = {1: (0, 0, 0), 10: (1, 0, 0), 11: (10, 0, 0), 12: (11, 0, 0), 20: (1, 0, 0),
             21: (20, 0, 0)}
    assert hl.tree_of(10, table) == {10, 11, 12}
    assert hl.tree_of(21, table) == {21}


def test_others_count_only_processes_outside_the_run(monkeypatch):
    """Between samples, CPU used by processes outside the run's tree counts as others'; the
    run's (even once orphaned) and this process's do not; a process started during the run
    counts from zero, one seen at the start from where it was."""
    me = hl.os.getpid()
    tables = iter([
        {me: (1, 100, 0), 50: (1, 1000, 0), 60: (me, 5, 99_000)},  # start; 60: the run
        {me: (1, 150, 0), 50: (1, 1040, 0), 60: (me, 80, 99_000), 61: (60, 30, 99_100),
         70: (1, 7, 99_200)},  # 61: a producer of the run; 70: new other work
        {me: (1, 160, 0), 50: (1, 1050, 0), 61: (1, 90, 99_100), 70: (1, 9, 99_200)},
    ])
    monkeypatch.setattr(hl, "process_table", lambda: next(tables))
    monkeypatch.setattr(hl, "steal_ticks", lambda: 0)
    monkeypatch.setattr(hl, "boot_ticks_now", lambda: 99_000)
    monitor = hl.HostLoadMonitor()
    monitor.steal0, monitor.boot0 = 0, 99_000
    monitor.seen = {pid: cpu for pid, (_, cpu, _) in next(tables).items()}
    monitor.root = 60
    monitor._sample()
    monitor._sample()
    assert monitor.others_ticks == (1040 - 1000) + 7 + (1050 - 1040) + (9 - 7)


def test_window_interpolates_the_sampled_counters():
    """The load over [a, b] is the counters' growth between a and b (linear between two
    samples); taken cores are (others' CPU + steal) / wall; outside the samples: refused."""
    monitor = hl.HostLoadMonitor()
    tick = hl.TICK_S
    monitor.series = [(10.0, 0, 0), (11.0, 100, 10), (13.0, 100, 30)]
    load = monitor.window(10.5, 12.0)
    assert load.wall_s == pytest.approx(1.5)
    assert load.others_cpu_s == pytest.approx(50 * tick)
    assert load.steal_s == pytest.approx(15 * tick)
    assert load.taken_cores == pytest.approx(65 * tick / 1.5)
    with pytest.raises(ValueError, match="outside the samples"):
        monitor.window(9.0, 12.0)


def test_a_busy_process_outside_the_run_is_seen():
    """A real process burning about 0.6 s of CPU beside a monitored (busy) run is counted:
    at least most of it (other work on a shared host may only add to it)."""
    monitor = hl.HostLoadMonitor(interval_s=0.05).start()
    run = subprocess.Popen([sys.executable, "-c", BUSY.format(s=0.6)])
    monitor.root = run.pid
    other = subprocess.Popen([sys.executable, "-c", BUSY.format(s=0.6)])
    other.wait(timeout=60)
    run.wait(timeout=60)
    time.sleep(0.1)
    monitor.stop()
    t0, t1 = monitor.series[0][0], monitor.series[-1][0]
    load = monitor.window(t0, t1)
    assert load.others_cpu_s >= 0.45
    assert load.taken_cores == pytest.approx((load.others_cpu_s + load.steal_s) / (t1 - t0))


def test_a_host_without_proc_serves_unmeasured(monkeypatch, tmp_path):
    """Without /proc the engine's command still runs and its output comes back, with no
    load measured (None: predicted as if the host were idle, and said so in the JSON)."""
    from pdsim.fit import serve_runs

    monkeypatch.setattr(serve_runs, "host_load_measurable", lambda: False)
    proc, monitor = serve_runs.serve_measured([sys.executable, "-c", "print('{}')"])
    assert (proc.returncode, proc.stdout.strip(), monitor) == (0, "{}", None)
    assert serve_runs.serving_load(None, tmp_path / "t.jsonl", 1.0) is None
    monkeypatch.undo()
    proc, monitor = serve_runs.serve_measured([sys.executable, "-c", "print(1)"])
    assert monitor is not None and len(monitor.series) >= 2
