"""Events per second of `pdref check` on a large, realistically interleaved trace.

The trace: contract version 2, qwen3-0.6b geometry (28 layers), many concurrent requests with
512..8192-token prompts, chunk 256 spans, stage events, failures, cancellations (aborts with
spans in flight), fences and retries, two producers. Also times a
bare `json.loads` of every line in the same run, so the checker's cost reads as a ratio.
Also: issue + land of a 128k-token prompt over 80 layers in 256-token spans, shuffled
(interval work must stay logarithmic-ish, not linear in the prompt).
Run: python bench/check_throughput.py [--events 200000] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from pdref import events as ev
from pdref.check import check_file
from pdref.models import load_model
from pdref.monitor import Monitor
from pdref.synth import SynthConfig, synth_trace
from pdref.trace import dumps

TARGET_EVENTS_PER_S = 100_000


def make_trace(path: Path, min_events: int, seed: int) -> dict:
    geometry = load_model("qwen3-0.6b").geometry()
    header = ev.Header("bench", ev.Mode.CHUNK, geometry, pool_pages=8192, max_pending=2,
                       extra=(("chunk", 256),))
    lines = [dumps(ev.header_to_json(header))]
    kinds: dict[str, int] = {}
    while len(lines) - 1 < min_events:
        config = SynthConfig(requests=200, max_live=12, min_prompt=512, max_prompt=8192,
                             chunk=256, fail_rate=0.01, cancel_rate=0.002, producers=2)
        batch = synth_trace(header, config, seed=seed)
        seed += 1
        offset = float(len(lines))  # later batches run later in time
        for e in batch:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
            obj = ev.event_to_json(e)
            obj["t"] += offset
            if "end" in obj:
                obj["end"] += offset
            obj["req"] = f"{seed}-{obj['req']}"
            if "span" in obj:
                obj["span"] = f"{seed}-{obj['span']}"
            lines.append(dumps(obj))
    path.write_text("\n".join(lines) + "\n")
    return kinds


def long_prompt_spans(shape: str, seed: int = 0) -> tuple[int, float]:
    """Land a 128k-token prompt of llama-3.1-70b (80 layers) in 256-token spans, shuffled.

    shape "chunk": 512 spans of all layers; "layer": 40,960 spans of one layer each.
    Returns (spans, seconds) for issue + land of every span and the admission.
    """
    geometry = load_model("llama-3.1-70b").geometry()
    prompt, layers = 131072, geometry.layers
    monitor = Monitor(ev.Header("bench", ev.Mode.CHUNK, geometry, 9000, max_pending=1))
    monitor.reserve(0.0, "r", prompt, 0)
    monitor.emit(ev.Computed(0.0, "r", (0, layers), (0, prompt)))
    if shape == "chunk":
        regions = [((0, layers), (a, a + 256)) for a in range(0, prompt, 256)]
    else:
        regions = [((k, k + 1), (a, a + 256)) for k in range(layers) for a in range(0, prompt, 256)]
    random.Random(seed).shuffle(regions)
    start = time.perf_counter()
    for span, (lay, tok) in enumerate(regions):
        monitor.emit(ev.Issue(0.0, "r", span, lay, tok, geometry.region_bytes(lay, tok)))
        monitor.emit(ev.Land(0.0, "r", span))
    monitor.emit(ev.Produced(0.0, "r", 0))
    monitor.emit(ev.Admit(0.0, "r"))
    return len(regions), time.perf_counter() - start


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bench.jsonl"
        kinds = make_trace(path, args.events, seed=1)
        count = sum(kinds.values())
        result = check_file(path)
        assert result.ok, result.text()
        check_s = best_of(lambda: check_file(path), args.repeats)
        parse_s = best_of(lambda: [json.loads(x) for x in path.open("rb")], args.repeats)
    report = {
        "version": ev.VERSION,
        "events": count,
        "fences": kinds.get("fence", 0),
        "aborts": kinds.get("abort", 0),
        "check_s": round(check_s, 3),
        "events_per_s": round(count / check_s),
        "json_parse_only_s": round(parse_s, 3),
        "check_over_parse_ratio": round(check_s / parse_s, 2),
        "target_events_per_s": TARGET_EVENTS_PER_S,
        "meets_target": count / check_s >= TARGET_EVENTS_PER_S,
    }
    for shape in ("chunk", "layer"):
        spans, seconds = long_prompt_spans(shape)
        report[f"long_prompt_{shape}_spans"] = spans
        report[f"long_prompt_{shape}_us_per_span"] = round(seconds / spans * 1e6, 1)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
