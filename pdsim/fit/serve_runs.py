"""`pdgpu serve` runs for `pdsim validate --serving`, as a subprocess (pdsim never imports
pdgpu).

A `ServePoint` is one serving configuration. Its requests are drawn here (seeded: prompt
lengths uniform over the point's range, token ids uniform over the model's vocabulary) and
written as a `--prompts` file in the engine's format, so the engine serves, and the simulator
later plays, the very same prompts in the same order. The engine writes its trace (for
`pdsim calibrate`) and prints its summary (`--json`: tokens_per_s, ttft_p50_s, ...).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import attrs

from pdsim.fit.engine_runs import EngineRunError, engine_failed, pacing_and_device
from pdsim.fit.host_load import HostLoad, HostLoadMonitor, host_load_measurable


@attrs.frozen
class ServePoint:
    """One `pdgpu serve` configuration (closed loop: `concurrency` requests in at once)."""

    concurrency: int
    prompt_range: tuple[int, int]  # drawn prompt lengths, both ends included
    output_tokens: int
    producers: int = 1
    mode: str = "chunk"
    link_gbps: float | None = None  # each span paced to this many GB/s (None: unpaced)
    requests: int = 8
    chunk: int = 64
    seed: int = 0

    @property
    def name(self) -> str:
        lo, hi = self.prompt_range
        link = f"-link{self.link_gbps:g}" if self.link_gbps else ""
        return (f"c{self.concurrency}-p{lo}_{hi}-o{self.output_tokens}-x{self.producers}-"
                f"{self.mode}{link}-n{self.requests}-s{self.seed}")


@attrs.frozen
class ServeRun:
    """One point as the engine served it: its prompts, trace and summary."""

    point: ServePoint
    prompts: list[dict]  # {"req", "tokens", "output_tokens"} in arrival order
    trace: str
    summary: dict  # pdgpu serve --json
    host_load: HostLoad | None = None  # other work on the host meanwhile (None: not measured)


S = ServePoint
# (point, role): "train" feeds calibration, "test" is held out, "repeat" (at the end) is
# neither; a training run every third run, from the first to the second-to-last of the 14
# scored, so that the host's drifts hit both halves
# alike (with the 5 training runs first among the 10 first, a grid's last 4 runs were all
# held out: in one grid those ran 9..19% faster than the training runs had, with no other
# load measured). 24..36 requests a point (10..30 s of serving on a quiet 2-core box; 8
# until the fourth session, 12..24 until 2026-12-03): the median TTFT of 8 requests moved
# 0.22..0.32 s between identical runs, and a longer run averages the host's bursts
# (hypervisor steal) over more.
# The two-producer training run is at concurrency 4: there the two producers' prefill and
# the decoder's steps run three at once on the two cores, as in the held-out two-producer
# points at concurrency 3; at concurrency 2 (the training run until 2026-12-03) at most two
# ran at once, and three-process sharing was extrapolated from `host_cores` alone.
SERVE_GRIDS = {
    "default": (
        (S(1, (64, 256), 16, requests=32), "train"),
        (S(2, (64, 256), 16, requests=36), "test"),
        (S(4, (64, 256), 32, mode="whole", requests=36), "test"),
        (S(4, (128, 512), 16, requests=36), "train"),
        (S(2, (256, 512), 16, producers=2, requests=32), "test"),
        (S(2, (128, 512), 32, mode="layer", requests=32), "test"),
        (S(4, (128, 512), 16, producers=2, requests=36), "train"),
        (S(4, (128, 512), 16, mode="whole", link_gbps=0.05, requests=36), "test"),
        (S(1, (256, 512), 32, mode="whole", requests=24), "test"),
        (S(3, (64, 384), 24, mode="layer", requests=36), "train"),
        (S(3, (64, 512), 24, producers=2, requests=32), "test"),
        (S(4, (256, 512), 8, link_gbps=0.05, requests=32), "test"),
        (S(2, (128, 512), 16, link_gbps=0.05, requests=36), "train"),
        (S(2, (64, 256), 48, producers=2, mode="whole", requests=32), "test"),
        # the grid's first two held-out points again, their very prompts, about 4 minutes
        # later: how far the host's own drift moves identical work (repeat_summary); neither
        # fitted nor scored
        (S(2, (64, 256), 16, requests=36), "repeat"),
        (S(4, (64, 256), 32, mode="whole", requests=36), "repeat"),
    ),
    "quick": (
        (S(2, (32, 96), 8, requests=4, chunk=32), "train"),
        (S(2, (32, 96), 12, requests=4, chunk=32, seed=1), "test"),
    ),
}


def draw_prompts(point: ServePoint, vocab: int) -> list[dict]:
    """The point's requests, seeded by its seed: the lines of a `--prompts` file."""
    rng = random.Random(point.seed)
    lo, hi = point.prompt_range
    return [{"req": f"r{i}", "tokens": [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))],
             "output_tokens": point.output_tokens} for i in range(point.requests)]


def serve_argv(point: ServePoint, model: str, prompts: Path, trace: Path,
               device: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "pdgpu", "serve", "--model", model, "--prompts", str(prompts),
            "--concurrency", str(point.concurrency), "--producers", str(point.producers),
            "--mode", point.mode, "--chunk", str(point.chunk), "--seed", str(point.seed),
            "--trace", str(trace), "--json", "--no-progress",
            "--no-prefix-cache"]  # a point is simulated without one (pdsim run's default)
    return argv + pacing_and_device(point.link_gbps, device)


def run_serve(point: ServePoint, model: str, vocab: int, folder: Path,
              device: str | None = None) -> ServeRun:
    """Serve the point's prompts on the engine (files under `folder`); its ServeRun."""
    folder.mkdir(parents=True, exist_ok=True)
    prompts = draw_prompts(point, vocab)
    prompts_path, trace = folder / "prompts.jsonl", folder / "trace.jsonl"
    prompts_path.write_text("".join(json.dumps(row) + "\n" for row in prompts))
    proc, monitor = serve_measured(serve_argv(point, model, prompts_path, trace, device))
    summary = _summary(proc.stdout)
    if proc.returncode != 0 or summary is None:
        raise engine_failed(proc, f"pdgpu serve on {point.name}")
    if summary.get("ok") != point.requests:
        raise EngineRunError(f"pdgpu serve on {point.name}: {summary.get('ok')} of "
                             f"{point.requests} requests ended ok")
    return ServeRun(point, prompts, str(trace), summary,
                    serving_load(monitor, trace, summary["wall_s"]))


def serving_load(monitor: HostLoadMonitor | None, trace: Path, wall_s: float
                 ) -> HostLoad | None:
    """Other work's share over the serving window: `wall_s` up to the trace's last write
    (serving had just ended); written beside the trace. None where nothing was sampled."""
    if monitor is None:
        return None
    end = trace.stat().st_mtime
    load = monitor.window(end - wall_s, end)
    (trace.parent / "host-load.json").write_text(json.dumps(
        {"serving": load.to_json(), "series": monitor.series}) + "\n")
    return load


def serve_measured(argv: list[str]) -> tuple[subprocess.CompletedProcess,
                                             HostLoadMonitor | None]:
    """Run the engine's command line; its output and the host's load sampled meanwhile
    (None on a host without Linux's /proc)."""
    monitor = HostLoadMonitor().start() if host_load_measurable() else None
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        if monitor is not None:
            monitor.root = proc.pid
        try:
            stdout, stderr = proc.communicate()
        except BaseException:  # as subprocess.run: no engine left behind
            proc.kill()
            raise
        finally:
            if monitor is not None:
                monitor.stop()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr), monitor


def _summary(stdout: str) -> dict | None:
    """The JSON summary: the last line of stdout that is a JSON object."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None
