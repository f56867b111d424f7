"""Matplotlib figures (Agg backend, returned as PNG bytes so callers write them atomically)."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pdsim.views.report import edge_note  # noqa: E402

MODE_COLORS = {"whole": "tab:blue", "chunk": "tab:orange", "layer": "tab:green"}
# Modes often give the same figures (chunk and layer on a fast link): each later mode is
# drawn on top with a thinner line, its own dash and a smaller marker, so a line that
# coincides with another still shows inside it instead of vanishing under it.
MODE_STYLES = {"whole": dict(ls="-", marker="o", ms=9, lw=3.0, zorder=2),
               "chunk": dict(ls="--", marker="s", ms=6, lw=2.0, zorder=3),
               "layer": dict(ls=":", marker="^", ms=4, lw=1.2, zorder=4)}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def plotted_rows(rows: list[dict]) -> list[dict]:
    """The sweep rows a sweep plot draws: those at the first row's max_pending and bandwidth."""
    first = rows[0]
    return [r for r in rows if r["max_pending"] == first["max_pending"]
            and r["bandwidth_scale"] == first["bandwidth_scale"]]


def sweep_png(rows: list[dict], best: dict[int, dict], title: str = "",
              fixed: bool = False) -> bytes:
    """Completion (top) and tail (bottom) vs chunk size per mode, one column per prompt;
    `best` is the sweep's best row per prompt among `plotted_rows(rows)` (marked by a line).
    The sweep computes it, so this module never imports the sweep. `fixed`: the chunks are
    not the reader's choice (edge_note)."""
    prompts = sorted({r["prompt"] for r in rows})
    first = rows[0]
    shown = plotted_rows(rows)
    fig, axes = plt.subplots(2, len(prompts), figsize=(5.5 * len(prompts), 6.5),
                             squeeze=False, sharex=True)
    for col, prompt in enumerate(prompts):
        _sweep_column(axes[0][col], axes[1][col], shown, prompt, best[prompt], fixed)
    shown_as = f"max_pending {first['max_pending']}"
    if first["bandwidth_scale"] != 1.0 or len({r["bandwidth_scale"] for r in rows}) > 1:
        shown_as += f", --bandwidths factor x{first['bandwidth_scale']:g}"
    fig.suptitle(f"{title}; plotted: {shown_as}", fontsize=9)
    return _png(fig)


def _sweep_column(top, bottom, rows: list[dict], prompt: int, best: dict,
                  fixed: bool) -> None:
    for mode, color in MODE_COLORS.items():
        pts = sorted((r["chunk"], r["handoff_s"], r["tail_s"]) for r in rows
                     if r["prompt"] == prompt and r["mode"] == mode)
        if pts:
            xs = [p[0] for p in pts]
            top.plot(xs, [p[1] * 1e3 for p in pts], color=color, label=mode, **MODE_STYLES[mode])
            bottom.plot(xs, [p[2] * 1e3 for p in pts], color=color, label=mode,
                        **MODE_STYLES[mode])
    chunks = sorted({r["chunk"] for r in rows if r["prompt"] == prompt})
    edge = edge_note(best["chunk"], chunks, fixed)
    for ax in (top, bottom):
        ax.axvline(best["chunk"], color="grey", lw=0.8, zorder=1,
                   label=f"best: {best['mode']}, chunk {best['chunk']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(chunks, [str(c) for c in chunks])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    top.set_ylabel("completion (handoff) ms")
    bottom.set_ylabel("unhidden tail ms")
    bottom.set_xlabel("chunk (tokens)")
    top.set_title(f"prompt {prompt}: best: mode {best['mode']}, chunk {best['chunk']}{edge}",
                  fontsize=9)
