"""The demo's report and sweep plots: in-sample errors explained, every marker labelled,
coinciding lines both visible, a best chunk at the edge of the swept range flagged."""

from __future__ import annotations

import types

from pdsim.sweep import format_table
from pdsim.views import plots
from pdsim.views.demo_report import in_sample_note, sweep_lines
from pdsim.views.report import edge_note

CHUNKS = (64, 128, 256)


def _rows(best_chunk: int) -> list[dict]:
    """Sweep rows of one prompt where chunk and layer coincide and `best_chunk` is best."""
    rows = []
    for mode in ("whole", "chunk", "layer"):
        for c in CHUNKS:
            handoff = 0.010 if mode != "whole" and c == best_chunk else 0.020
            rows.append({"mode": mode, "prompt": 1024, "chunk": c, "max_pending": 2,
                         "bandwidth_scale": 1.0, "handoff_s": handoff, "tail_s": handoff / 4,
                         "peak_staging_bytes": 2**20 if mode == "chunk" else 2**21})
    return rows


def _best(rows: list[dict]) -> dict:
    return min(rows, key=lambda r: (r["handoff_s"], r["peak_staging_bytes"], r["chunk"]))


def test_edge_note_flags_the_smallest_and_largest_chunk_only():
    """Best at either end of the range says "widen it"; inside it, nothing."""
    assert "edge of the range 64..256: widen it" in edge_note(256, CHUNKS)
    assert "widen it" in edge_note(64, CHUNKS)
    assert edge_note(128, CHUNKS) == ""


def test_report_and_table_flag_a_best_chunk_at_the_edge(tmp_path):
    """pdsim sweep's table (the user's range) says "widen it"; the demo report's sweep
    section (the demo's own fixed range) states the edge without that advice."""
    rows = _rows(256)
    sweep = {"model": "m", "hw": "h", "prompt": 1024, "label": "x", "png": "x.png",
             "rows": rows, "best": _best(rows)}
    report = "\n".join(sweep_lines([sweep]))
    assert "edge of the range swept here, 64..256" in report and "widen it" not in report
    assert "widen it" in format_table(rows)
    inside = _rows(128)
    assert "edge" not in "\n".join(sweep_lines([{**sweep, "rows": inside,
                                                  "best": _best(inside)}]))


def test_in_sample_note_says_what_the_errors_mean_with_their_range():
    """The report gives this run's error range and why in-sample errors are not forecasts."""
    measured = [types.SimpleNamespace(handoff_s=1.0), types.SimpleNamespace(handoff_s=2.0)]
    predicted = [{"handoff_s": 1.25}, {"handoff_s": 1.7}]
    text = in_sample_note(list(zip(measured, predicted, strict=True)))
    assert "here -15% .. +25%" in text
    assert "in-sample" in text and "not a forecast" in text and "pdsim validate" in text


def test_sweep_plot_labels_the_best_line_and_keeps_coinciding_lines_visible(monkeypatch):
    """The grey best line has a legend entry; each mode has its own dash and marker and a
    later mode is drawn above, thinner, so chunk stays visible on layer's equal figures."""
    monkeypatch.setattr(plots, "_png", lambda fig: fig)
    rows = _rows(128)
    fig = plots.sweep_png(rows, {1024: _best(rows)}, title="t")
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "best: chunk, chunk 128" in labels and {"whole", "chunk", "layer"} <= set(labels)
        lines = {line.get_label(): line for line in ax.get_lines()}
        styles = {(lines[m].get_linestyle(), lines[m].get_marker()) for m in plots.MODE_STYLES}
        assert len(styles) == 3
        assert lines["layer"].get_zorder() > lines["chunk"].get_zorder()
        assert lines["layer"].get_linewidth() < lines["chunk"].get_linewidth()
