"""The Gantt chart of a run: one row per resource, spans coloured by stage, pending count."""

from __future__ import annotations

from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from pdsim.perfetto import lanes, pending_series
from pdsim.plots import _png, plt

STAGE_COLORS = {"compute": "tab:blue", "gather": "tab:red", "d2h": "tab:orange",
                "h2d": "tab:green", "net": "tab:purple"}


def gantt_png(events, title: str = "") -> bytes:
    rows = lanes(events)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 1.2 + 0.5 * len(rows) + 1.6),
                                  sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    bars: dict[str, list] = {}
    for e in events:
        if e.kind == "stage":
            bars.setdefault((e.resource or e.name, e.name), []).append((e.t * 1e3,
                                                                         (e.end - e.t) * 1e3))
    for (lane, name), spans in bars.items():
        ax.broken_barh(spans, (rows.index(lane) - 0.4, 0.8),
                       color=STAGE_COLORS.get(name, "tab:gray"), edgecolor="black", lw=0.2)
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


def _legend(ax, stages: list[str]) -> None:
    """One colour key per stage drawn, outside the lanes so it hides no bar."""
    handles = [Patch(facecolor=STAGE_COLORS.get(s, "tab:gray"), edgecolor="black", lw=0.2,
                     label=s) for s in stages]
    if handles:
        ax.legend(handles=handles, title="stage", fontsize=7, title_fontsize=7,
                  loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
