"""The rows of `pdsim validate --serving`: one a point, what the engine measured and what
the simulator predicted, pass by pass and pooled.

A point served in several passes (serve_runs.Part; validate_serving.SERVE_PASSES) is scored
as one run: tokens/s over every pass's tokens and serving time, each latency figure the
passes' mean weighted by their requests. The predictions of its passes (each played with
that pass's own prompts and measured host load) are pooled the same way, so measured and
predicted figures stay alike. With one pass a row is its run as served.
"""

from __future__ import annotations

import attrs

from pdsim.fit.host_load import HostLoad
from pdsim.fit.serve_runs import ServePoint, ServeRun

POOLED_LATENCIES = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "handoff_p50_s")


def pooled_summary(summaries: list[dict]) -> dict:
    """A point's passes as one run: tokens/s is every pass's tokens over their summed serving
    time (`wall_s`), each latency figure the mean of the passes' weighted by their requests
    (`ok`). One pass: its summary as is. Measured and predicted passes are pooled alike."""
    if len(summaries) == 1:
        return summaries[0]
    wall = sum(s["wall_s"] for s in summaries)
    ok = sum(s["ok"] for s in summaries)
    tokens = sum(s["tokens_per_s"] * s["wall_s"] for s in summaries)
    pooled = {"ok": ok, "requests": sum(s.get("requests", s["ok"]) for s in summaries),
              "wall_s": wall, "tokens_per_s": tokens / wall}
    for key in POOLED_LATENCIES:
        if all(s.get(key) is not None for s in summaries):
            pooled[key] = sum(s[key] * s["ok"] for s in summaries) / ok
    return pooled


def pooled_load(loads: list[HostLoad | None]) -> HostLoad | None:
    """Other work's share over all of a point's passes (None if any pass was unmeasured)."""
    if any(load is None for load in loads):
        return None
    return HostLoad(sum(x.wall_s for x in loads), sum(x.others_cpu_s for x in loads),
                    sum(x.steal_s for x in loads), loads[0].cores)


@attrs.frozen
class ServeRow:
    """One serving configuration: what the engine measured and what the simulator predicted,
    pass by pass (`runs`, `predictions`: one each per pass of the point) and pooled."""

    runs: tuple[ServeRun, ...]
    role: str
    predictions: tuple[dict, ...]

    @property
    def run(self) -> ServeRun:
        """The passes pooled as one run (the run itself when there is one pass)."""
        if len(self.runs) == 1:
            return self.runs[0]
        first = self.runs[0]
        return ServeRun(first.point, [p for r in self.runs for p in r.prompts], first.trace,
                        pooled_summary([r.summary for r in self.runs]),
                        pooled_load([r.host_load for r in self.runs]))

    @property
    def predicted(self) -> dict:
        return pooled_summary(list(self.predictions))

    def err_pct(self, key: str) -> float:
        """|predicted / measured - 1| of one summary figure, in percent."""
        return 100.0 * abs(self.predicted[key] / self.run.summary[key] - 1.0)

    def to_json(self) -> dict:
        run, predicted = self.run, self.predicted
        point = attrs.asdict(run.point)
        out = {**point, "name": run.point.name, "role": self.role, "trace": run.trace,
               **{f"measured_{k}": run.summary.get(k) for k in FIGURES},
               **{f"predicted_{k}": predicted.get(k) for k in FIGURES},
               "tps_err_pct": self.err_pct("tokens_per_s"),
               "ttft_p50_err_pct": self.err_pct("ttft_p50_s"),
               "host_load": run.host_load.to_json() if run.host_load else None}
        if len(self.runs) > 1:
            out["passes"] = [pass_json(r, p) for r, p in zip(self.runs, self.predictions,
                                                             strict=True)]
        return out


FIGURES = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "handoff_p50_s", "wall_s")


def pass_json(run: ServeRun, predicted: dict) -> dict:
    """One pass of a point: its trace, requests, host load, measured and predicted figures."""
    return {"pass": run.part.index, "trace": run.trace, "requests": len(run.prompts),
            **{f"measured_{k}": run.summary.get(k) for k in FIGURES},
            **{f"predicted_{k}": predicted.get(k) for k in FIGURES},
            "host_load": run.host_load.to_json() if run.host_load else None}


def point_rows(runs: list[tuple[ServeRun, str]], predictions: list[dict]) -> list[ServeRow]:
    """The passes of each point as one row, points in the order first served."""
    groups: dict[ServePoint, tuple[list, str, list]] = {}
    for (run, role), predicted in zip(runs, predictions, strict=True):
        got = groups.setdefault(run.point, ([], role, []))
        got[0].append(run)
        got[2].append(predicted)
    return [ServeRow(tuple(rs), role, tuple(ps)) for rs, role, ps in groups.values()]


def format_table(rows: list[ServeRow]) -> str:
    """One line a point: measured and predicted tokens/s and TTFT p50, their errors."""
    lines = [f"{'role':5} {'point':44} {'tok/s':>7} {'pred':>7} {'err%':>6} "
             f"{'TTFT50 ms':>9} {'pred':>8} {'err%':>6}"]
    for r in rows:
        m, p = r.run.summary, r.predicted
        lines.append(f"{r.role:5} {r.run.point.name:44} {m['tokens_per_s']:7.1f} "
                     f"{p['tokens_per_s']:7.1f} {r.err_pct('tokens_per_s'):6.1f} "
                     f"{m['ttft_p50_s'] * 1e3:9.1f} {p['ttft_p50_s'] * 1e3:8.1f} "
                     f"{r.err_pct('ttft_p50_s'):6.1f}")
    return "\n".join(lines)
