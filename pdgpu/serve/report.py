"""Results and summary of a serving run (contract.md, 'Serving runs'), from the decoder's
record of each request and from the trace (handoff times via pdref.metrics)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdgpu.decode_graph import GraphedStep
from pdgpu.serve.decoder import Decoder, Tracked
from pdgpu.serve.ledger import Ledger
from pdref.metrics import life_metrics
from pdref.outfile import write_atomic

SUMMARY_ORDER = ("requests", "ok", "failed", "cancelled", "tokens_per_s", "ttft_p50_s",
                 "ttft_p99_s", "itl_p50_s", "itl_p99_s", "handoff_p50_s", "peak_pool_pages",
                 "leaked_pages", "wall_s")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in (0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def result_line(t: Tracked) -> dict:
    ok = t.status == "ok"
    ttft = t.token_t[0] - t.arrival if (t.token_t and t.arrival is not None) else None
    e2e = t.done_t - t.arrival if (t.done_t is not None and t.arrival is not None) else None
    line = {"req": t.req, "status": str(t.status), "output": list(t.output) if ok else [],
            "ttft_s": ttft, "e2e_s": e2e, "attempts": t.attempts}
    if not ok:
        line["reason"] = t.reason
    return line


def write_results(decoder: Decoder, path: str | Path) -> None:
    """One line per request, in workload order; written whole or not at all."""
    lines = [json.dumps(result_line(t)) for t in decoder.tracked.values()]
    write_atomic(path, "".join(line + "\n" for line in lines))


class ResultsLog:
    """`--results` written as the run goes: created empty at the start, a line appended (one
    write, line-buffered) as each request ends, so the file always holds whole lines, one
    per request ended so far, in the order they ended. At the end it is replaced (renamed
    into place, never half there) by every request's line in workload order (one a run
    stopped early never got to is there too, with its status)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        write_atomic(self.path, "")
        self.file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def add(self, t: Tracked) -> None:
        self.file.write(json.dumps(result_line(t)) + "\n")

    def close(self, decoder: Decoder | None) -> None:
        if self.file.closed:
            return
        self.file.close()
        if decoder is not None:
            write_results(decoder, self.path)

    def remove(self) -> None:
        """A run refused before it served (bad input, exit 2): no file is left."""
        self.file.close()
        self.path.unlink(missing_ok=True)


def summary(decoder: Decoder, ledger: Ledger, wall_s: float) -> dict:
    tracked = list(decoder.tracked.values())
    ok = [t for t in tracked if t.status == "ok"]
    itl = [b - a for t in ok for a, b in zip(t.token_t, t.token_t[1:], strict=False)]
    ttft = [t.token_t[0] - t.arrival for t in ok]
    lives, _ = life_metrics(ledger.log.protocol())  # read back: the run kept none
    handoff = [life.ready_t - life.reserve_t for life in lives
               if life.outcome == "released" and life.ready_t is not None]
    generated = sum(len(t.output) for t in ok)
    return {
        "requests": len(tracked), "ok": len(ok),
        "failed": sum(t.status == "failed" for t in tracked),
        "cancelled": sum(t.status == "cancelled" for t in tracked),
        "tokens_per_s": generated / wall_s if wall_s > 0 else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "handoff_p50_s": percentile(handoff, 50),
        "peak_pool_pages": ledger.peak_pages,
        "leaked_pages": ledger.leaked_pages,
        "wall_s": wall_s,
        "mode": str(ledger.header.mode),
        "pool_pages": ledger.header.pool_pages,
        "producers": len(decoder.members.peers),
        "producer_kills": decoder.members.kills,
        "producer_deaths": decoder.members.deaths,
        "producer_restarts": decoder.members.restarts,
        "generated_tokens": generated,
        "spans": sum(life.spans for life in lives),
        "failed_spans": sum(life.failed_spans for life in lives),
        "lives": len(lives),
        "stages_clamped": ledger.log.stages_clamped,
        "transport": dict(ledger.header.extra).get("transport"),  # shm, gloo, nccl, ...
        "kv_bytes_by_lane": _received(decoder),  # which lane carried the bytes, measured
        "verify_s": ledger.kv_landing.verify_s,  # the decoder's seconds checking landed bytes
        "decode_graph_captures": _captures(decoder),
        **_cache_state(dict(ledger.header.extra)),
        **_decoder_cache(decoder),
        **ledger.check_metrics(wall_s),  # live checks' share of wall, the audit's lag
    }


def _cache_state(header: dict) -> dict:
    """Whether the run's prefix caches were on, and why not where the header says."""
    why = header.get("prefix_cache_off")
    return {"prefix_cache": header.get("prefix_cache"),
            **({} if why is None else {"prefix_cache_off": why})}


def _decoder_cache(decoder: Decoder) -> dict:
    """Prompt tokens each reserve looked up in the decoder's prefix cache and found there
    (`--prefix-cache`; a retried request's every life counts), or nothing."""
    cache = decoder.prefix_cache
    if cache is None:
        return {}
    return {"decoder_cache_queries": cache.queries, "decoder_cache_hits": cache.hits}


def _captures(decoder: Decoder) -> int | None:
    """Decode-step layouts captured as CUDA graphs (`--cuda-graphs`), None when eager."""
    forward = decoder.forward
    return forward.captures if isinstance(forward, GraphedStep) else None


def _received(decoder: Decoder) -> dict[str, int] | None:
    """Tensor bytes the decoder received by the lane that carried them (a shared-memory lane
    whose /dev/shm had no room sent those messages over gloo)."""
    received = getattr(decoder.members.transport, "received_bytes", None)
    return None if received is None else received()


def format_summary(values: dict) -> str:
    keys = list(SUMMARY_ORDER) + [k for k in values if k not in SUMMARY_ORDER]
    lines = []
    for key in keys:
        v = values.get(key)
        text = f"{v:.6f}" if isinstance(v, float) else ("null" if v is None else str(v))
        lines.append(f"{key:>18}: {text}")
    return "\n".join(lines)
