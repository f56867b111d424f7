"""Run the modes on the same prompt: KV parity against `whole`, and ratios side by side."""

from __future__ import annotations

import attrs
import torch

from pdgpu.engine import Engine, RunResult
from pdgpu.model import Transformer
from pdgpu.workload import EngineConfig, Request

RATIO_KEYS = ("prefill_s", "handoff_s", "tail_s", "peak_staging_bytes", "source_alloc_bytes")
TABLE_KEYS = ("spans", "prefill_s", "handoff_s", "tail_s", "copy_s", "peak_staging_bytes",
              "source_alloc_bytes", "first_token")


@attrs.frozen
class Parity:
    kv_equal: bool  # every request's decoder KV (and a hybrid's state) bit-identical to whole's
    token_equal: bool  # every request's first token the same as whole's

    @property
    def ok(self) -> bool:
        return self.kv_equal and self.token_equal


def parity(result: RunResult, baseline: RunResult) -> Parity:
    pairs = list(zip(result.outcomes, baseline.outcomes, strict=True))
    kv = all(a.kv is not None and torch.equal(a.kv, b.kv) and _same_state(a.state, b.state)
             for a, b in pairs)
    token = all(a.first_token == b.first_token for a, b in pairs)
    return Parity(kv, token)


def _same_state(a: tuple | None, b: tuple | None) -> bool:
    """Two landed states (StatePool.read's pairs, or None for a model without one) alike."""
    if a is None or b is None:
        return a is b
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


@attrs.frozen
class CompareReport:
    results: dict  # mode -> RunResult
    parities: dict  # mode -> Parity against whole

    @property
    def parity_ok(self) -> bool:
        return all(p.ok for p in self.parities.values())

    def ratios(self, mode: str) -> dict:
        base, run = self.results["whole"].metrics, self.results[mode].metrics
        return {f"{k}_ratio": _ratio(run.get(k), base.get(k)) for k in RATIO_KEYS}

    def summary(self) -> dict:
        return {mode: {"metrics": r.metrics, "parity": attrs.asdict(self.parities[mode]),
                       "vs_whole": self.ratios(mode)} for mode, r in self.results.items()}


def compare_modes(model: Transformer, configs: dict[str, EngineConfig],
                  requests: list[Request]) -> CompareReport:
    """Run each mode's config on the same requests (whole first: the baseline)."""
    results = {mode: Engine(model, cfg).run(requests) for mode, cfg in configs.items()}
    parities = {mode: parity(r, results["whole"]) for mode, r in results.items()}
    return CompareReport(results, parities)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "-" if value is None else str(value)


def compare_table(report: CompareReport) -> str:
    """A text table: one row per mode, metrics, parity and ratios against whole."""
    cols = ["mode", *TABLE_KEYS, "kv==whole", "token==whole", "handoff/whole", "tail/whole",
            "staging/whole"]
    rows = [cols]
    for mode, result in report.results.items():
        ratios, p = report.ratios(mode), report.parities[mode]
        rows.append([mode, *(_cell(result.metrics.get(k)) for k in TABLE_KEYS),
                     str(p.kv_equal), str(p.token_equal),
                     _cell(ratios["handoff_s_ratio"]), _cell(ratios["tail_s_ratio"]),
                     _cell(ratios["peak_staging_bytes_ratio"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    verdict = "parity: ok" if report.parity_ok else "parity: FAILED"
    return "\n".join([*lines, verdict])
