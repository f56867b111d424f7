"""`pdsim timeline`: a Gantt PNG of one run (compute lane, copy lanes, pending count) and,
with `--perfetto FILE`, the same run as Chrome trace-event JSON (opens in ui.perfetto.dev or
chrome://tracing): one track per resource (compute, gather, d2h/h2d/net of each producer), a
counter of spans in flight, and instant markers for produced and admit. The Gantt chart has
one row per resource, spans coloured by stage, and the pending count below."""

from __future__ import annotations

import json

from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from pdsim.core.play import simulate
from pdsim.options import UsageError, add_run_options, run_setup
from pdsim.views.plots import _png, plt
from pdsim.views.report import write_atomic

US = 1e6
STAGE_COLORS = {"compute": "tab:blue", "gather": "tab:red", "d2h": "tab:orange",
                "h2d": "tab:green", "net": "tab:purple"}


def add_args(p) -> None:
    add_run_options(p)
    p.add_argument("--png", default="timeline.png", help="Gantt chart file")
    p.add_argument("--perfetto", default=None, help="write Chrome trace-event JSON here")


def command(args) -> int:
    cfg, requests = run_setup(args)
    if not cfg.stages:
        raise UsageError("timeline needs stage events")
    result = simulate(cfg, requests)
    title = ", ".join(f"{k} {v}" for k, v in cfg.labels) + f", mode {cfg.mode}, chunk {cfg.chunk}"
    png = gantt_png(result.events, title)
    if args.perfetto:
        write_atomic(args.perfetto, json.dumps(chrome_trace(result.events, title)))
    write_atomic(args.png, png)
    print(f"wrote {args.png}" + (f" and {args.perfetto}" if args.perfetto else ""))
    return 0


def lanes(events) -> list[str]:
    """Resource names in first-seen order (the Gantt chart's rows)."""
    seen: dict[str, None] = {}
    for e in events:
        if e.kind == "stage":
            seen.setdefault(e.resource or e.name, None)
    return list(seen)


def pending_series(events) -> list[tuple[float, int]]:
    """(t, spans in flight) after every issue/land/fail."""
    live, out = 0, [(0.0, 0)]
    for e in events:
        if e.kind in ("issue", "land", "fail"):
            live += 1 if e.kind == "issue" else -1
            out.append((e.t, live))
    return out


def chrome_trace(events, title: str = "pdsim") -> dict:
    """The run as Chrome trace-event JSON: a track per lane, instants, the in-flight counter."""
    tids = {lane: i + 1 for i, lane in enumerate(lanes(events))}
    out = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}}]
    out += [{"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": lane}}
            for lane, tid in tids.items()]
    for e in events:
        if e.kind == "stage":
            args = {"req": e.req} | ({"span": e.span} if e.span is not None else {})
            out.append({"ph": "X", "pid": 1, "tid": tids[e.resource or e.name], "name": e.name,
                        "ts": e.t * US, "dur": (e.end - e.t) * US, "args": args})
        elif e.kind in ("produced", "admit", "reserve", "release"):
            out.append({"ph": "i", "pid": 1, "tid": 0, "s": "p", "name": f"{e.kind} {e.req}",
                        "ts": e.t * US})
    out += [{"ph": "C", "pid": 1, "name": "spans in flight", "ts": t * US, "args": {"n": n}}
            for t, n in pending_series(events)]
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def gantt_png(events, title: str = "") -> bytes:
    """Lanes over time (top) and spans in flight (bottom), as PNG bytes."""
    rows = lanes(events)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 1.2 + 0.5 * len(rows) + 1.6),
                                  sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    bars: dict[str, list] = {}
    for e in events:
        if e.kind == "stage":
            bars.setdefault((e.resource or e.name, e.name), []).append((e.t * 1e3,
                                                                         (e.end - e.t) * 1e3))
    for (lane, name), spans in bars.items():
        color = stage_color(name)  # edge too: a bar thinner than its edge shows the edge
        ax.broken_barh(spans, (rows.index(lane) - 0.4, 0.8), facecolor=color,
                       edgecolor=color, lw=0.5, label=name)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    _legend(ax, sorted({name for _, name in bars}, key=_stage_order))
    ax.set_title(title, fontsize=9)
    series = pending_series(events)
    ax2.step([t * 1e3 for t, _ in series], [n for _, n in series], where="post")
    ax2.set_ylabel("spans in flight")
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_xlabel("ms")
    return _png(fig)


def _stage_order(name: str) -> tuple[int, str]:
    order = list(STAGE_COLORS)
    return (order.index(name) if name in order else len(order), name)


def stage_color(name: str) -> str:
    """One colour per stage, the bars' and their legend key's (fill and edge alike: a short
    stage's bar is all edge, so a black edge made it read darker than its key)."""
    return STAGE_COLORS.get(name, "tab:gray")


def _legend(ax, stages: list[str]) -> None:
    """One colour key per stage drawn, outside the lanes so it hides no bar."""
    handles = [Patch(facecolor=stage_color(s), edgecolor=stage_color(s), lw=0.5, label=s)
               for s in stages]
    if handles:
        ax.legend(handles=handles, title="stage", fontsize=7, title_fontsize=7,
                  loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
