"""`pdsim cache`: what a prefix cache of each size is worth on one workload (issue 35): the
same requests (e.g. `--sessions 32 --turns 4 --system-prompt 1024`) simulated once per cache
size, both sides given that many pages; one row per size: hit rate, tokens computed, bytes
handed off, TTFT p50/p99, tokens/s. Every run is checked by pdref (contract v4)."""

from __future__ import annotations

import argparse
import json

import attrs

from pdsim.core.metrics import workload_metrics
from pdsim.core.play import simulate
from pdsim.options import UsageError, add_run_options, run_setup

COLUMNS = ("cache_pages", "prefix_cache_hit_rate", "producer_prefix_cache_hits", "bytes",
           "ttft_p50_s", "ttft_p99_s", "tokens_per_s", "wall_s")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated page counts, got {text!r}") \
            from None
    if not sizes or any(n < 0 for n in sizes):
        raise argparse.ArgumentTypeError(f"must be page counts >= 0, got {text!r}")
    return sizes


def add_args(p: argparse.ArgumentParser) -> None:
    add_run_options(p)
    p.add_argument("--cache-pages", type=_sizes, default=(0, 64, 256, 1024, 4096),
                   help="cache sizes to compare, pages on each side (0: no cache)")
    p.add_argument("--json", action="store_true", help="print one JSON object per size")


def whatif(cfg, requests, sizes) -> list[dict]:
    """One row per cache size (both sides that many pages): the run's metrics."""
    rows = []
    for pages in sizes:
        run = attrs.evolve(cfg, decoder_cache_pages=pages, producer_cache_pages=pages)
        metrics = workload_metrics(simulate(run, requests))
        rows.append({"cache_pages": pages, **{k: metrics.get(k) for k in COLUMNS[1:]}})
    return rows


def command(args) -> int:
    if args.prefix_cache or args.decoder_cache_pages is not None \
            or args.producer_cache_pages is not None:
        raise UsageError("pdsim cache sets the caches' sizes itself (--cache-pages); give it "
                         "without --prefix-cache and --*-cache-pages")
    cfg, requests = run_setup(args)
    rows = whatif(cfg, requests, args.cache_pages)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print("  ".join(f"{c:>26}" if i == 1 else f"{c:>12}" for i, c in enumerate(COLUMNS)))
    for row in rows:
        print("  ".join(_cell(row[c], 26 if i == 1 else 12) for i, c in enumerate(COLUMNS)))
    return 0


def _cell(value, width: int) -> str:
    if isinstance(value, float):
        return f"{value:>{width}.4g}"
    return f"{value!s:>{width}}"
