"""bench/engine_overlap.py runs end to end on a tiny workload and reports every ratio."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "engine_overlap.py"


def test_overlap_bench_reports_ratios_and_targets(capsys, tmp_path):
    """One round on `tiny`: JSON with medians per mode, the ratios, targets and bandwidth."""
    main = runpy.run_path(str(BENCH))["main"]
    out = tmp_path / "bench.json"
    args = ["--model", "tiny", "--prompt", "64", "--chunk", "16", "--repeats", "1",
            "--link-gbps", "0.002", "--json", "--out", str(out)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out.read_text())
    assert set(result["median"]) == {"whole", "chunk", "layer", "oneshot", "export_whole",
                                     "export_chunk"}
    assert result["ratios"]["chunk_staging_spans"] == 2.0
    assert result["ratios"]["export_chunk_over_whole"] > 0
    assert {m["threads"] for m in result["median"].values()} == {result["threads"]}
    assert result["median"]["chunk"]["tail_s"] < result["median"]["whole"]["tail_s"]
    assert result["copy_bandwidth"]["d2h_gbps"] > 0


def test_export_curve_reports_whole_and_chunked_per_payload(capsys):
    """--export-only --payloads: one row per payload with both times and their ratio."""
    main = runpy.run_path(str(BENCH))["main"]
    args = ["--model", "tiny", "--chunk", "16", "--repeats", "1", "--link-gbps", "0.01",
            "--export-only", "--payloads", "2e4,6e4", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["export_curve"]
    assert [r["payload"] for r in rows] == [20000, 60000]
    assert all(r["whole_s"] > 0 and r["chunk_s"] > 0 and r["chunk_over_whole"] > 0 for r in rows)
    assert rows[1]["whole_s"] > rows[0]["whole_s"]  # three times the bytes on a paced link
