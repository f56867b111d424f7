"""pdsim figures: readable sweep title, timeline colour key, validation plot keeps every point."""

from __future__ import annotations

import types

import pytest

from pdsim.cli import main
from pdsim.views import plots, timeline, validate_plot


def _figure_instead_of_png(monkeypatch, module):
    """Make `module`'s PNG step hand back the matplotlib figure for inspection."""
    monkeypatch.setattr(module, "_png", lambda fig: fig)


def test_sweep_png_title_is_words_not_a_json_dict(tmp_path, monkeypatch):
    """`pdsim sweep --png` titles the figure "model on hw under engine (link ...)",
    no raw dict."""
    titles = []
    monkeypatch.setattr(plots, "sweep_png",
                        lambda rows, best, title: titles.append(title) or b"png")
    assert main(["sweep", "--prompts", "512", "--chunks", "128,256", "--quiet",
                 "--bandwidth-scale", "2", "--png", str(tmp_path / "s.png")]) == 0
    assert titles == ["qwen3-0.6b on a100-pcie under production (link pcie-gen4), "
                      "bandwidth x2"]


def test_timeline_has_a_colour_key_for_each_stage_drawn(monkeypatch):
    """The Gantt chart's legend names exactly the stages that have bars."""
    from pdsim.core.play import simulate
    from pdsim.options import Parser, add_run_options, run_setup

    parser = Parser()
    add_run_options(parser)
    cfg, requests = run_setup(parser.parse_args(["--prompt", "512", "--chunk", "256",
                                                 "--mode", "chunk"]))
    events = simulate(cfg, requests).events
    _figure_instead_of_png(monkeypatch, timeline)
    fig = timeline.gantt_png(events)
    legend = fig.axes[0].get_legend()
    assert legend is not None
    drawn = {e.name for e in events if e.kind == "stage"}
    assert {t.get_text() for t in legend.get_texts()} == drawn
    keys = {t.get_text(): tuple(h.get_facecolor())
            for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)}
    for bars in fig.axes[0].collections:  # fill and edge: a short bar is all edge
        assert {tuple(c) for c in bars.get_facecolor()} == {keys[bars.get_label()]}
        assert {tuple(c) for c in bars.get_edgecolor()} == {keys[bars.get_label()]}


def _row(mode, role, measured, predicted):
    m = types.SimpleNamespace(mode=mode, handoff_s=measured[0], tail_s=measured[1])
    return types.SimpleNamespace(measured=m, role=role,
                                 predicted={"handoff_s": predicted[0], "tail_s": predicted[1]})


ROWS = [
    _row("whole", "train", (0.50, 0.12), (0.52, 0.11)),
    _row("whole", "test", (1.40, 0.30), (1.35, 0.31)),
    _row("chunk", "train", (0.45, 0.002), (0.46, 0.0)),  # predicted tail 0: log axes can't
    _row("chunk", "test", (0.90, 0.0), (0.88, 0.0)),
    _row("layer", "test", (0.07, 0.004), (0.071, 0.0038)),
]


def test_validation_plot_draws_zero_tails_instead_of_dropping_them(monkeypatch):
    """Every row is a marker on both panels; 0 ms values are counted in the panel's note."""
    _figure_instead_of_png(monkeypatch, validate_plot)
    fig = validate_plot.validation_png(ROWS)
    handoff, tail = fig.axes
    for ax in (handoff, tail):
        markers = sum(len(c.get_offsets()) for c in ax.collections)
        assert markers == len(ROWS)
    assert any("2 value(s) of 0 ms" in t.get_text() for t in tail.texts)


# Less than a decade: matplotlib then labels minor ticks too (2x10^2, 3x10^2, ...).
NARROW = [_row(m, "test", (h, t), (h * 1.05, t * 0.95)) for m, h, t in (
    ("whole", 0.16, 0.0012), ("chunk", 0.31, 0.0021), ("layer", 0.55, 0.0034),
    ("whole", 0.83, 0.0045))]


@pytest.mark.parametrize("rows", [ROWS, NARROW], ids=["decades", "narrow"])
@pytest.mark.parametrize("panel", [0, 1])
def test_validation_tick_labels_do_not_overlap(monkeypatch, panel, rows):
    """No two visible tick labels of an axis overlap once drawn."""
    _figure_instead_of_png(monkeypatch, validate_plot)
    fig = validate_plot.validation_png(rows)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[panel]
    for axis in (ax.xaxis, ax.yaxis):
        boxes = [t.get_window_extent(renderer) for t in axis.get_ticklabels(which="both")
                 if t.get_visible() and t.get_text()]
        assert len(boxes) >= 2
        for i, a in enumerate(boxes):
            assert not any(a.overlaps(b) for b in boxes[i + 1:]), axis.axis_name
