"""Chrome trace-event JSON of a run (opens in ui.perfetto.dev or chrome://tracing).

One track per resource (compute, gather, d2h/h2d/net of each producer), a counter of spans
in flight, and instant markers for produced and admit.
"""

from __future__ import annotations

US = 1e6


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
