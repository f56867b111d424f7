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
    assert set(result["median"]) == {"whole", "chunk", "layer", "oneshot"}
    assert result["ratios"]["chunk_staging_spans"] == 2.0
    assert result["median"]["chunk"]["tail_s"] < result["median"]["whole"]["tail_s"]
    assert result["copy_bandwidth"]["d2h_gbps"] > 0
