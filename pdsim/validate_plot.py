"""Predicted-vs-measured figure of `pdsim validate` (handoff left, tail right)."""

from __future__ import annotations

from pdsim.plots import MODE_COLORS, _png, plt


def validation_png(rows) -> bytes:
    """Scatter of predicted against measured handoff and tail; the diagonal is perfect."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, key, label in ((axes[0], "handoff_s", "handoff"), (axes[1], "tail_s", "tail")):
        _scatter(ax, rows, key)
        ax.set_xlabel(f"measured {label} (ms)")
        ax.set_ylabel(f"predicted {label} (ms)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    axes[0].set_title("engine vs simulator: hollow = training, filled = held out", fontsize=9)
    return _png(fig)


def _scatter(ax, rows, key: str) -> None:
    values = []
    for mode, color in MODE_COLORS.items():
        for role, face in (("train", "none"), ("test", color)):
            pts = [(getattr(r.measured, key) * 1e3, r.predicted[key] * 1e3) for r in rows
                   if r.measured.mode == mode and r.role == role]
            pts = [(x, y) for x, y in pts if x > 0 and y > 0]
            if pts:
                ax.scatter(*zip(*pts, strict=True), edgecolors=color, facecolors=face,
                           label=f"{mode} ({role})", s=28)
                values += [v for p in pts for v in p]
    if values:
        lo, hi = min(values) / 1.3, max(values) * 1.3
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
