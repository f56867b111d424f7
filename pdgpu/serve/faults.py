"""Seeded fault injection for `pdgpu serve` (issue 10): the one object every injection point
asks, so no fault lives in a hot loop. Same options and meanings as `pdsim run`
(specs/contract.md, 'Faults'):

- `--fail-rate P`: a span's copy fails (the producer reports the failure instead of bytes).
- `--stall-rate P`: a span's writer hangs after its issue until its request's cancel reaches
  it (the decoder sends one at the span's deadline, `--span-timeout`, which it needs).
- `--corrupt-rate P`: a span's bytes are altered after their checksums were taken (in
  transit); `--verify` turns that into a `fail` (it needs `--verify`).
- `--cancel-rate P`: a request is cancelled after a drawn number of its steps (messages of
  its lives and decoded tokens), so in any phase, queued ones included.
- `--kill-producer I@S`: producer index I (rank I+1, `p{I+1}` in the trace) is SIGKILLed S
  seconds after t = 0; `--restart-producers` respawns it.

Each draw is a pure function of (seed, kind, key): a span's fate depends on its life's handle
and its region, not on timing or on what other processes did, so a seed picks the same faults
in every process and every run.
"""

from __future__ import annotations

import enum
import hashlib
import math

import attrs


class Fate(enum.Enum):
    OK = "ok"
    FAIL = "fail"
    STALL = "stall"
    CORRUPT = "corrupt"


def _rate(_inst, attribute, value) -> None:
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(f"{attribute.name.replace('_', '-')}: must be a probability in "
                         f"[0, 1], got {value}")


@attrs.frozen
class Kill:
    """Producer index `producer` (rank producer + 1) is killed at trace time `t`."""

    producer: int
    t: float


def parse_kill(text: str) -> Kill:
    """`I@SECONDS` -> Kill; ValueError naming the rule (the index is checked later)."""
    index, at, seconds = text.partition("@")
    try:
        kill = Kill(int(index), float(seconds))
    except ValueError:
        raise ValueError(f"kill-producer: must be I@SECONDS (a producer index and a time), "
                         f"got {text!r}") from None
    if not at or not (kill.t >= 0 and math.isfinite(kill.t)):
        raise ValueError(f"kill-producer: SECONDS must be a finite number >= 0, got {text!r}")
    return kill


@attrs.frozen
class FaultSpec:
    """What a run injects; the defaults inject nothing. Travels to producers as JSON."""

    fail_rate: float = attrs.field(default=0.0, validator=_rate)
    stall_rate: float = attrs.field(default=0.0, validator=_rate)
    corrupt_rate: float = attrs.field(default=0.0, validator=_rate)
    cancel_rate: float = attrs.field(default=0.0, validator=_rate)
    seed: int = 0

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> FaultSpec:
        return cls(**obj)

    def _draw(self, kind: str, key: str) -> float:
        """Uniform in [0, 1), a pure function of (seed, kind, key)."""
        digest = hashlib.blake2b(f"{self.seed}/{kind}/{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64

    def span_fate(self, handle: str, layers, tokens) -> Fate:
        """What happens to the copy of this region of this life (producer side)."""
        key = f"{handle}/{layers[0]}:{layers[1]}/{tokens[0]}:{tokens[1]}"
        if self.stall_rate and self._draw("stall", key) < self.stall_rate:
            return Fate.STALL
        if self.fail_rate and self._draw("fail", key) < self.fail_rate:
            return Fate.FAIL
        if self.corrupt_rate and self._draw("corrupt", key) < self.corrupt_rate:
            return Fate.CORRUPT
        return Fate.OK

    def cancel_step(self, req: str, steps: int) -> int | None:
        """After how many of its `steps` (expected in a fault-free life) request `req` is
        cancelled, or None: 0 cancels it in the queue, before its first reserve."""
        if not self.cancel_rate or self._draw("cancel", req) >= self.cancel_rate:
            return None
        return int(self._draw("cancel-at", req) * steps)


@attrs.frozen
class FaultPolicy:
    """How the decoder meets faults (its side only; the FaultSpec travels to producers)."""

    span_timeout: float | None = None  # a span not landed this long after its issue fails
    heartbeat_timeout: float = 5.0  # a producer silent this long is declared dead
    max_attempts: int = 3  # lives per request before it is failed (a cancel is not retried)
    restart_producers: bool = False  # a dead local producer is respawned and rejoins
    kills: tuple[Kill, ...] = ()  # local producers SIGKILLed at these trace times

    def check(self, producers: int, faults: FaultSpec, verify: bool) -> None:
        """ValueError naming the option and the rule (bad input, exit 2)."""
        for kill in self.kills:
            if not 0 <= kill.producer < producers:
                raise ValueError(f"kill-producer: producer index must be in [0, {producers}) "
                                 f"(--producers {producers}), got {kill.producer}@{kill.t:g}")
        if faults.stall_rate and self.span_timeout is None:
            raise ValueError("stall-rate: needs --span-timeout (a stalled span without a "
                             "deadline never ends)")
        if faults.corrupt_rate and not verify:
            raise ValueError("corrupt-rate: needs --verify (nothing else can see altered "
                             "bytes: they would land as wrong tokens)")
