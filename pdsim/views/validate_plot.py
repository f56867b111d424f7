"""Predicted-vs-measured figures of `pdsim validate` (handoff left, tail right) and of
`pdsim validate --serving` (tokens/s left, TTFT p50 right)."""

from __future__ import annotations

from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from pdsim.views.plots import MODE_COLORS, _png, plt


def validation_png(rows) -> bytes:
    """Scatter of predicted against measured handoff and tail; the diagonal is perfect.

    Log axes cannot show 0 ms (a tail the copy hid completely): such points are drawn as
    triangles on the axis floor and counted in the panel, never dropped.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, key, label in ((axes[0], "handoff_s", "handoff"), (axes[1], "tail_s", "tail")):
        _scatter(ax, rows, key)
        ax.set_xlabel(f"measured {label} (ms)")
        ax.set_ylabel(f"predicted {label} (ms)")
        _log_axes(ax)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_title("engine vs simulator: hollow = training, filled = held out", fontsize=9)
    fig.tight_layout()
    return _png(fig)


def _points(rows, key: str, mode: str, role: str) -> list[tuple[float, float]]:
    """(measured ms, predicted ms) of one mode and role."""
    return [(getattr(r.measured, key) * 1e3, r.predicted[key] * 1e3) for r in rows
            if r.measured.mode == mode and r.role == role]


def _scatter(ax, rows, key: str) -> None:
    every = [p for m in MODE_COLORS for role in ("train", "test")
             for p in _points(rows, key, m, role)]
    positive = [v for p in every for v in p if v > 0]
    if not positive:
        return
    floor = min(positive) / 2  # where a 0 ms value is drawn
    zeros = 0
    for mode, color in MODE_COLORS.items():
        for role, face in (("train", "none"), ("test", color)):
            pts = _points(rows, key, mode, role)
            kept = [(x, y) for x, y in pts if x > 0 and y > 0]
            at_zero = [(max(x, floor), max(y, floor)) for x, y in pts if x <= 0 or y <= 0]
            zeros += len(at_zero)
            if kept:
                ax.scatter(*zip(*kept, strict=True), edgecolors=color, facecolors=face,
                           label=f"{mode} ({role})", s=28)
            if at_zero:
                ax.scatter(*zip(*at_zero, strict=True), edgecolors=color, facecolors=face,
                           marker="v", s=36, label=None if kept else f"{mode} ({role})")
    lo, hi = floor / 1.3, max(positive) * 1.3
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    if zeros:
        ax.text(0.02, 0.97, f"triangles: {zeros} value(s) of 0 ms, drawn at {floor:.3g} ms",
                transform=ax.transAxes, fontsize=7, va="top")


def _log_axes(ax) -> None:
    """Log scales with plain-number labels at 1-2-5 steps only (no crowded minor labels)."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.tick_params(axis="y", labelsize=7)


def serving_png(rows) -> bytes:
    """Scatter of predicted against measured tokens/s and median TTFT, one point per serve
    run (colour: mode; hollow = training, filled = held out); the diagonal is perfect."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    for ax, key, label, scale in ((axes[0], "tokens_per_s", "tokens/s", 1.0),
                                  (axes[1], "ttft_p50_s", "TTFT p50 (ms)", 1e3)):
        _serving_panel(ax, rows, key, scale)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
    axes[0].set_title("pdgpu serve vs serving simulator", fontsize=9)
    fig.tight_layout()
    return _png(fig)


def _serving_panel(ax, rows, key: str, scale: float) -> None:
    values = []
    for mode, color in MODE_COLORS.items():
        for role, face in (("train", "none"), ("test", color)):
            pts = [(r.run.summary[key] * scale, r.predicted[key] * scale) for r in rows
                   if r.run.point.mode == mode and r.role == role]
            if pts:
                ax.scatter(*zip(*pts, strict=True), edgecolors=color, facecolors=face,
                           label=f"{mode} ({role})", s=28)
                values += [v for p in pts for v in p]
    if values:
        lo, hi = min(values) / 1.2, max(values) * 1.2
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.legend(fontsize=7, loc="lower right")
