"""Fault injection for `pdsim run`: what can go wrong, when each span's writer stops, and the
command-line options that describe it.

The kinds are those of `pdgpu serve` (issue 10), so their cost on TTFT and throughput can be
asked of the simulator first:
- `--fail-rate P`: a span's copy fails; the error is detected at a drawn point of its copy
  (`fail`), its writer runs its stages out and stops at the copy's end (`fence`).
- `--stall-rate P`: a span's writer hangs; it fails at its deadline (`--span-timeout`), the
  producer acknowledges the cancel `--fence-delay` later (`fence`).
- `--span-timeout S`: any span not landed S after its issue fails then (queued spans behind
  a stall too); its writer stops at its copy's end or at the acknowledged cancel.
- `--corrupt-rate P` (needs `--verify`): a span's bytes are altered in transit; the copy runs
  out, the decoder's check of the landed bytes against the compute-time checksums finds it
  (`fail`), and the decoder, which wrote them, fences it at once (`fence`), as pdgpu serve.
- `--cancel-rate P`: a request is cancelled at a drawn moment after its first `reserve`,
  uniform over a fault-free life's length (pipeline lower bound plus decode), so often while
  its spans are in flight (`abort` with spans in flight; a queued retry leaves the queue); the
  cancelled writers are fenced when they stop (their copy's end: a copy worker cannot drop a
  span it accepted), and the life's pages come back only at its last fence.
- `--kill-producer I@T`: producer I dies at T; `--heartbeat-timeout` later its spans fail and
  are fenced (the transport is torn down) and its requests are retried on the others;
  `--restart-producers` brings it back `--restart-delay` after that.
A failed life is retried as a new life up to `--max-attempts` lives in all. Every draw comes
from `--seed`, so a seed gives one trace.
"""

from __future__ import annotations

import argparse
import math
import random

import attrs

RATE_OPTIONS = ("fail_rate", "stall_rate", "cancel_rate", "corrupt_rate")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _rate(_inst, attribute, value) -> None:
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(f"{_flag(attribute.name)} must be a probability in [0, 1], got {value}")


def _positive_or_none(_inst, attribute, value) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{_flag(attribute.name)} must be > 0 seconds, got {value}")


def _positive(_inst, attribute, value) -> None:
    _positive_or_none(_inst, attribute, value)


def _non_negative(_inst, attribute, value) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{_flag(attribute.name)} must be >= 0 seconds, got {value}")


def _at_least_one(_inst, attribute, value) -> None:
    if value < 1:
        raise ValueError(f"{_flag(attribute.name)} must be >= 1, got {value}")


@attrs.frozen
class Kill:
    """Producer `producer` (its index) dies at virtual time `t`."""

    producer: int
    t: float


@attrs.frozen
class FaultSpec:
    """The faults of one run; the defaults inject none."""

    fail_rate: float = attrs.field(default=0.0, validator=_rate)
    stall_rate: float = attrs.field(default=0.0, validator=_rate)
    cancel_rate: float = attrs.field(default=0.0, validator=_rate)
    kills: tuple[Kill, ...] = ()
    span_timeout: float | None = attrs.field(default=None, validator=_positive_or_none)
    heartbeat_timeout: float = attrs.field(default=1.0, validator=_positive)
    fence_delay: float = attrs.field(default=0.001, validator=_non_negative)
    max_attempts: int = attrs.field(default=3, validator=_at_least_one)
    restart_producers: bool = False
    restart_delay: float = attrs.field(default=2.0, validator=_non_negative)
    seed: int = 0
    corrupt_rate: float = attrs.field(default=0.0, validator=_rate)
    verify: bool = False  # the decoder checks landed bytes against compute-time checksums

    def __attrs_post_init__(self) -> None:
        if self.stall_rate > 0 and self.span_timeout is None:
            raise ValueError("--stall-rate needs --span-timeout (a stalled span without a "
                             "deadline never ends)")
        if self.corrupt_rate > 0 and not self.verify:
            raise ValueError("--corrupt-rate needs --verify (unchecked, altered bytes would be "
                             "decoded: the simulator cannot say what the tokens become)")

    @property
    def active(self) -> bool:
        """Whether anything can go wrong (a deadline alone can fire on a slow link)."""
        return bool(self.fail_rate or self.stall_rate or self.cancel_rate or self.kills
                    or self.corrupt_rate or self.span_timeout is not None)

    def check_producers(self, producers: int) -> None:
        for kill in self.kills:
            if not 0 <= kill.producer < producers:
                raise ValueError(f"--kill-producer {kill.producer}@{kill.t}: producer index "
                                 f"must be in [0, {producers}) (--producers {producers})")


@attrs.frozen
class SpanFate:
    """When one span's writer stops (`stop_t`, it lands then unless it fails first) and, for
    a failing span, when and why it fails (`fail_t` <= `stop_t`)."""

    stop_t: float
    fail_t: float | None = None
    error: str | None = None
    stalled: bool = False


class Draws:
    """The seeded random choices of a run: one stream per request-level and span-level use,
    so adding a span draw never shifts the per-request ones."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self._requests = random.Random(spec.seed * 4 + 1)
        self._spans = random.Random(spec.seed * 4 + 2)
        self._corrupt = random.Random(spec.seed * 4 + 3)  # its own: other draws stay as before

    def cancel_fraction(self) -> float | None:
        """For each request in workload order: None, or where in its life it is cancelled."""
        chosen, where = self._requests.random(), self._requests.random()
        return where if chosen < self.spec.cancel_rate else None

    def span_fate(self, issue_t: float, start: float, copy_end: float) -> SpanFate:
        """The fate of a span issued at `issue_t` whose copy would run [start, copy_end)."""
        spec, rng = self.spec, self._spans
        stall, fail, where = rng.random(), rng.random(), rng.random()
        deadline = math.inf if spec.span_timeout is None else issue_t + spec.span_timeout
        cancel_ack = deadline + spec.fence_delay
        if stall < spec.stall_rate:
            return SpanFate(max(start, cancel_ack), deadline, "stalled past its deadline", True)
        if fail < spec.fail_rate:
            detect = start + where * (copy_end - start)
            if detect <= deadline:
                return SpanFate(copy_end, detect, "copy failed")
        if copy_end <= deadline:
            if spec.corrupt_rate and self._corrupt.random() < spec.corrupt_rate:
                return SpanFate(copy_end, copy_end, "checksum mismatch (corrupted in transit)")
            return SpanFate(copy_end)
        return SpanFate(max(start, min(copy_end, cancel_ack)), deadline, "deadline passed")


def parse_kill(text: str) -> Kill:
    """`I@SECONDS` -> Kill; the form only (the index range is checked against --producers)."""
    index, at, seconds = text.partition("@")
    try:
        kill = Kill(int(index), float(seconds))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be I@SECONDS (a producer index and a time), "
                                         f"got {text!r}") from None
    if not at or not (kill.t >= 0 and math.isfinite(kill.t)):
        raise argparse.ArgumentTypeError(f"must be I@SECONDS with SECONDS >= 0, got {text!r}")
    return kill


def add_fault_options(p: argparse.ArgumentParser) -> None:
    """`pdsim run`'s fault injection (see this module's docstring)."""
    g = p.add_argument_group("fault injection (seeded by --seed)")
    g.add_argument("--fail-rate", type=float, default=0.0, help="chance a span's copy fails")
    g.add_argument("--stall-rate", type=float, default=0.0,
                   help="chance a span's writer hangs until its deadline (needs --span-timeout)")
    g.add_argument("--corrupt-rate", type=float, default=0.0,
                   help="chance a span's bytes are altered in transit; found at its land by "
                        "--verify (needs it): fail, fence, retry")
    g.add_argument("--verify", action="store_true",
                   help="the decoder checks each landed span against compute-time checksums")
    g.add_argument("--cancel-rate", type=float, default=0.0,
                   help="chance a request is cancelled, at a drawn moment within a fault-free "
                        "life's length after its first reserve")
    g.add_argument("--kill-producer", type=parse_kill, action="append", default=None,
                   metavar="I@SECONDS", help="producer I dies at SECONDS (repeatable)")
    g.add_argument("--span-timeout", type=float, default=None,
                   help="a span not landed this many seconds after its issue fails "
                        "(default: no deadline)")
    g.add_argument("--heartbeat-timeout", type=float, default=1.0,
                   help="seconds from a producer's death until it is declared dead")
    g.add_argument("--fence-delay", type=float, default=0.001,
                   help="seconds for a producer to acknowledge the cancel of a stalled or "
                        "timed-out span")
    g.add_argument("--max-attempts", type=int, default=3,
                   help="lives per request before it is failed (a cancel is not retried)")
    g.add_argument("--restart-producers", action="store_true",
                   help="a dead producer rejoins --restart-delay after it is declared dead")
    g.add_argument("--restart-delay", type=float, default=2.0,
                   help="seconds a dead producer takes to rejoin (with --restart-producers)")


def fault_spec(args, producers: int) -> FaultSpec | None:
    """The FaultSpec `pdsim run`'s options describe, or None when they inject nothing."""
    spec = FaultSpec(args.fail_rate, args.stall_rate, args.cancel_rate,
                     tuple(args.kill_producer or ()), args.span_timeout, args.heartbeat_timeout,
                     args.fence_delay, args.max_attempts, args.restart_producers,
                     args.restart_delay, args.seed, args.corrupt_rate, args.verify)
    spec.check_producers(producers)
    return spec if spec.active else None
