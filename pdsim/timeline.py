"""`pdsim timeline`: a Gantt PNG of one run (compute lane, copy lanes, pending count) and,
with `--perfetto FILE`, the same run as Chrome trace-event JSON."""

from __future__ import annotations

import json

from pdsim.options import UsageError, add_run_options, run_setup
from pdsim.perfetto import chrome_trace
from pdsim.report import write_atomic
from pdsim.sim import simulate


def add_args(p) -> None:
    add_run_options(p)
    p.add_argument("--png", default="timeline.png", help="Gantt chart file")
    p.add_argument("--perfetto", default=None, help="write Chrome trace-event JSON here")


def command(args) -> int:
    cfg, requests = run_setup(args)
    if not cfg.stages:
        raise UsageError("timeline needs stage events")
    result = simulate(cfg, requests)
    from pdsim.gantt import gantt_png

    title = ", ".join(f"{k} {v}" for k, v in cfg.labels) + f", mode {cfg.mode}, chunk {cfg.chunk}"
    png = gantt_png(result.events, title)
    if args.perfetto:
        write_atomic(args.perfetto, json.dumps(chrome_trace(result.events, title)))
    write_atomic(args.png, png)
    print(f"wrote {args.png}" + (f" and {args.perfetto}" if args.perfetto else ""))
    return 0
