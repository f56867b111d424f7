"""Workloads: arrival times (fixed list, fixed interval, or Poisson or gamma at a rate; closed
loop: SimConfig.concurrency), prompt lengths (fixed, uniform in a range, from a CSV with a
`prompt` column and optional `arrival` and `prefix` columns, or from a `pdgpu serve` prompts
file, prompts.py) and output tokens (the run's, uniform in a range, or each prompt line's);
or all three from a request trace file (trace_file.py). Seeded, so equal inputs give equal
workloads.

`workload()` gives the requests as an iterable in arrival order. Drawn ones are drawn as
they are read, `DRAW_PART` at a time (`GeneratedWorkload`), and a trace file is read as a
stream, so a run of a million requests never holds them all; prompt files and `--arrivals`
are read whole. A workload of up to DRAW_PART requests draws each column in one call, as
it always did; a longer one in parts, which gives the same values but where numpy's
bounded integers reject a draw at a part's end (about once in 2^32 / range draws)."""

from __future__ import annotations

import csv
from pathlib import Path

import attrs
import numpy as np

from pdref.prompts import read_prompts, shared_prefix
from pdsim.core.config import RequestSpec
from pdsim.core.trace_file import TraceFileWorkload
from pdsim.core.workload_rules import WorkloadError, checked_prefix


@attrs.frozen
class WorkloadSpec:
    """How to draw the requests of a run (validated by `build_requests`)."""

    requests: int | None = None  # None: one per CSV row or --arrivals time, else 1
    prompt: int = 8192
    prefix: int | None = None  # None: a CSV row's own prefix, else 0
    prompt_range: tuple[int, int] | None = None
    prompts_csv: str | None = None
    rate: float | None = None  # Poisson arrivals, requests per second
    interval: float | None = None  # fixed spacing between arrivals (None: all at t = 0)
    arrivals: tuple[float, ...] | None = None
    seed: int = 0
    prompts_jsonl: str | None = None  # pdgpu serve's --prompts file
    output_range: tuple[int, int] | None = None  # output tokens uniform in [A, B]
    arrival_shape: float | None = None  # gamma inter-arrivals of this shape (None: Poisson)
    trace_file: str | None = None  # arrivals, prompts and outputs from a trace (CSV/JSONL)


DRAW_PART = 1 << 16  # requests drawn at a time (even: numpy's 32-bit draws come in pairs)


def workload(spec: WorkloadSpec, page_tokens: int):
    """The requests of a workload in arrival order (ties: workload order), as an iterable
    that can be read more than once: drawn or read as it is read where it can be."""
    if spec.trace_file is not None:
        return TraceFileWorkload(spec, page_tokens)
    if _generated(spec):
        return GeneratedWorkload(spec, page_tokens)
    return build_requests(spec, page_tokens)


def _generated(spec: WorkloadSpec) -> bool:
    return spec.prompts_csv is None and spec.prompts_jsonl is None and spec.arrivals is None


def build_requests(spec: WorkloadSpec, page_tokens: int) -> list[RequestSpec]:
    """The requests of a workload (r0, r1, ... or the prompts file's names), in arrival
    order (ties: workload order)."""
    if spec.trace_file is None and _generated(spec):
        return list(GeneratedWorkload(spec, page_tokens))
    rng = np.random.default_rng(spec.seed)
    rows = _rows(spec)
    count = _count(spec, rows)
    prompts = _prompts(spec, rows, count, rng)
    times = _arrivals(spec, rows, count, rng)
    outputs = _outputs(spec, rows, count, rng)  # drawn last: earlier draws stay as they were
    out = []
    for i, (t, prompt) in enumerate(zip(times, prompts, strict=True)):
        prefix = _prefix(spec, rows, i, prompt, page_tokens)
        name = rows[i].get("req", f"r{i}") if rows is not None else f"r{i}"
        out.append(RequestSpec(name, float(t), int(prompt), prefix, outputs[i]))
    order = sorted(range(count), key=lambda i: (out[i].arrival, i))
    return [out[i] for i in order]


def _rows(spec: WorkloadSpec) -> list[dict] | None:
    if spec.prompts_csv and spec.prompts_jsonl:
        raise WorkloadError("prompts: give one of --prompts-csv and --prompts, got both")
    if spec.prompts_jsonl:
        lines = read_prompts(spec.prompts_jsonl)
        if spec.prefix:
            shared_prefix(lines, spec.prefix)
        return [{"req": line.req, "prompt": line.prompt, "tokens": list(line.tokens),
                 "output_tokens": line.output_tokens} for line in lines]
    return _read_csv(spec.prompts_csv) if spec.prompts_csv else None


def _outputs(spec: WorkloadSpec, rows, count: int, rng) -> list[int | None]:
    """Each request's output tokens; None: the run's --output-tokens."""
    if spec.output_range is not None:
        lo, hi = _checked_output_range(spec)
        if rows is not None and any(r.get("output_tokens") is not None for r in rows):
            raise WorkloadError("--output-range and the prompts file's output_tokens both "
                                "give output lengths; give one")
        return [int(x) for x in rng.integers(lo, hi + 1, size=count)]
    if rows is not None:
        return [row.get("output_tokens") for row in rows]
    return [None] * count


def _count(spec: WorkloadSpec, rows) -> int:
    """How many requests; a --requests that contradicts the CSV or --arrivals is refused."""
    implied = {"prompt rows": None if rows is None else len(rows),
               "--arrivals times": None if spec.arrivals is None else len(spec.arrivals)}
    implied = {k: v for k, v in implied.items() if v is not None}
    count = spec.requests if spec.requests is not None else next(iter(implied.values()), 1)
    if count < 1:
        raise WorkloadError(f"--requests must be >= 1, got {count}")
    for what, n in implied.items():
        if n != count:
            raise WorkloadError(f"--requests is {count} but there are {n} {what}; "
                                "give one request per row / time")
    return count


def _prompts(spec: WorkloadSpec, rows, count: int, rng) -> list[int]:
    if rows is not None:
        return [row["prompt"] for row in rows]
    if spec.prompt_range is not None:
        lo, hi = _checked_prompt_range(spec)
        return [int(x) for x in rng.integers(lo, hi + 1, size=count)]
    if spec.prompt < 1:
        raise WorkloadError(f"--prompt must be >= 1, got {spec.prompt}")
    return [spec.prompt] * count


def _checked_prompt_range(spec: WorkloadSpec) -> tuple[int, int]:
    lo, hi = spec.prompt_range
    if not 1 <= lo <= hi:
        raise WorkloadError(f"--prompt-range must be A:B with 1 <= A <= B, got {lo}:{hi}")
    if (spec.prefix or 0) > lo:
        raise WorkloadError(f"--prefix {spec.prefix} must be <= the shortest prompt of "
                            f"--prompt-range {lo}:{hi}")
    return lo, hi


def _checked_output_range(spec: WorkloadSpec) -> tuple[int, int]:
    lo, hi = spec.output_range
    if not 0 <= lo <= hi:
        raise WorkloadError(f"--output-range must be A:B with 0 <= A <= B, got {lo}:{hi}")
    return lo, hi


def _arrivals(spec: WorkloadSpec, rows, count: int, rng) -> list[float]:
    _one_arrival_source(spec, rows)
    if spec.arrivals is not None:
        if any(not t >= 0 for t in spec.arrivals):
            raise WorkloadError(f"--arrivals must list {count} times >= 0")
        return list(spec.arrivals)
    if rows is not None and "arrival" in rows[0]:
        return [row["arrival"] for row in rows]
    if spec.rate is not None:
        if not spec.rate > 0:
            raise WorkloadError(f"--rate must be > 0 requests/s, got {spec.rate}")
        return list(np.cumsum(rng.exponential(1.0 / spec.rate, size=count)) - 0.0)
    interval = 0.0 if spec.interval is None else spec.interval
    if not interval >= 0:
        raise WorkloadError(f"--interval must be >= 0 s, got {interval}")
    return [i * interval for i in range(count)]


def _one_arrival_source(spec: WorkloadSpec, rows) -> None:
    """Two ways to time arrivals would silently override one another: refused."""
    given = [name for name, value in (("--arrivals", spec.arrivals), ("--rate", spec.rate),
                                      ("--interval", spec.interval)) if value is not None]
    with_time = [] if rows is None else [("arrival" in row) for row in rows]
    if any(with_time):
        if not all(with_time):
            line = with_time.index(False) + 2
            raise WorkloadError(f"--prompts-csv: {spec.prompts_csv}:{line}: arrival is missing "
                                "(give it on every row or on none)")
        given.append("--prompts-csv arrival column")
    if len(given) > 1:
        raise WorkloadError(f"arrival times: give one of --arrivals, --rate, --interval or a "
                            f"CSV arrival column, got {' and '.join(given)}")


def _prefix(spec: WorkloadSpec, rows, i: int, prompt: int, page_tokens: int) -> int:
    row_prefix = None if rows is None else rows[i].get("prefix")
    if row_prefix is not None and spec.prefix is not None:
        raise WorkloadError(f"--prefix {spec.prefix} and the --prompts-csv prefix column "
                            "both give request prefixes; give one")
    prefix = row_prefix if row_prefix is not None else spec.prefix or 0
    return checked_prefix(prefix, prompt, page_tokens)


def _read_csv(path: str) -> list[dict]:
    try:
        with open(Path(path), newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise WorkloadError(f"--prompts-csv: cannot read {path}: {e}") from None
    if not rows or "prompt" not in rows[0]:
        raise WorkloadError(f"--prompts-csv: {path} needs a header row with a 'prompt' column")
    return [_row(path, n, row) for n, row in enumerate(rows, 2)]


def _row(path: str, line: int, row: dict) -> dict:
    out = {}
    for key, convert in (("prompt", int), ("prefix", int), ("arrival", float)):
        if row.get(key) not in (None, ""):
            try:
                out[key] = convert(row[key])
            except ValueError:
                raise WorkloadError(f"--prompts-csv: {path}:{line}: {key} {row[key]!r} is not a "
                                    f"{convert.__name__}") from None
    if out.get("prompt", 0) < 1:
        raise WorkloadError(f"--prompts-csv: {path}:{line}: prompt must be >= 1")
    return out


class GeneratedWorkload:
    """The requests of a WorkloadSpec with neither prompt file nor arrival list, drawn
    DRAW_PART at a time as they are read. Each column (prompts, arrivals, outputs) is drawn
    from the generator's state where the column before it ended, as one run of draws would
    have it: the states are found once, drawing each column through without keeping it."""

    def __init__(self, spec: WorkloadSpec, page_tokens: int) -> None:
        self.spec, self.page_tokens = spec, page_tokens
        self.count = _count(spec, None)
        prompts, self._arrivals = _prompt_draw(spec), _arrival_draw(spec)
        outputs = _output_draw(spec)
        self._prompts, self._outputs = prompts, outputs
        self.states = []
        state = np.random.default_rng(spec.seed).bit_generator.state
        for draw in (prompts, self._arrivals, outputs):
            self.states.append(state)
            if draw is not None:
                state = _state_after(state, draw, self.count)

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        spec, count = self.spec, self.count
        prompts = _parts(self.states[0], self._prompts, count, spec.prompt)
        outputs = _parts(self.states[2], self._outputs, count, None)
        gaps = None if self._arrivals is None else _parts(self.states[1], self._arrivals,
                                                          count, None)
        interval = 0.0 if spec.interval is None else spec.interval
        t = 0.0
        for start in range(0, count, DRAW_PART):
            size = min(DRAW_PART, count - start)
            prompt, output = next(prompts), next(outputs)
            if gaps is None:
                times = [(start + i) * interval for i in range(size)]
            else:  # a running sum, as one cumsum of every gap would add them
                times = np.cumsum(np.concatenate([[t], next(gaps)]))[1:].tolist()
                t = times[-1]
            for i in range(size):
                prefix = _prefix(spec, None, start + i, prompt[i], self.page_tokens)
                yield RequestSpec(f"r{start + i}", float(times[i]), int(prompt[i]), prefix,
                                  output[i])


def _parts(state, draw, count: int, fixed):
    """Lists of DRAW_PART draws (the last: the rest) from `state`; without a draw, `fixed`
    repeated."""
    rng = _rng_at(state)
    for start in range(0, count, DRAW_PART):
        size = min(DRAW_PART, count - start)
        yield [fixed] * size if draw is None else draw(rng, size).tolist()


def _rng_at(state) -> np.random.Generator:
    bits = np.random.PCG64()
    bits.state = state
    return np.random.Generator(bits)


def _state_after(state, draw, count: int):
    rng = _rng_at(state)
    for start in range(0, count, DRAW_PART):
        draw(rng, min(DRAW_PART, count - start))
    return rng.bit_generator.state


def _prompt_draw(spec: WorkloadSpec):
    """How a part of the prompts is drawn (None: every prompt is --prompt); checks them."""
    if spec.prompt_range is None:
        if spec.prompt < 1:
            raise WorkloadError(f"--prompt must be >= 1, got {spec.prompt}")
        return None
    lo, hi = _checked_prompt_range(spec)
    return lambda rng, size: rng.integers(lo, hi + 1, size=size)


def _arrival_draw(spec: WorkloadSpec):
    """How a part of the gaps between arrivals is drawn (None: fixed interval)."""
    _one_arrival_source(spec, None)
    if spec.arrival_shape is not None and spec.rate is None:
        raise WorkloadError("--arrival-shape needs --rate (it shapes the gaps between arrivals)")
    if spec.rate is None:
        if not (0.0 if spec.interval is None else spec.interval) >= 0:
            raise WorkloadError(f"--interval must be >= 0 s, got {spec.interval}")
        return None
    if not spec.rate > 0:
        raise WorkloadError(f"--rate must be > 0 requests/s, got {spec.rate}")
    mean, shape = 1.0 / spec.rate, spec.arrival_shape
    if shape is None:
        return lambda rng, size: rng.exponential(mean, size=size)
    if not shape > 0:
        raise WorkloadError(f"--arrival-shape must be > 0, got {shape}")
    return lambda rng, size: rng.gamma(shape, mean / shape, size=size)


def _output_draw(spec: WorkloadSpec):
    """How a part of the outputs is drawn (None: the run's --output-tokens)."""
    if spec.output_range is None:
        return None
    lo, hi = _checked_output_range(spec)
    return lambda rng, size: rng.integers(lo, hi + 1, size=size)
