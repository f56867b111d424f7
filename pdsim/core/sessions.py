"""Multi-turn sessions sharing a system prompt: the workload a prefix cache is for.

Each of `sessions` conversations sends `turns` requests. Turn k's prompt is the shared
system prompt, then every earlier turn's user tokens and answer, then its own user tokens:

    prompt_k = system + sum_{j<k} (user_j + output_j) + user_k

so a turn's leading tokens are its previous turn's prompt (and, before that, every
session's system prompt). The first turns arrive at `rate` (Poisson), at `interval`, or all
at 0; turn k + 1 arrives when turn k was released plus the user's think time (exponential,
mean `think_s`). Seeded: equal specs give equal sessions.

A `SessionWorkload` iterates over the first turns in arrival order (what a Sim starts from)
and holds the later ones as `followups` (req -> (think time, request)), which the Sim plays
as each turn ends; `all_turns()` lists every turn (to size pools and check contexts).
"""

from __future__ import annotations

import attrs
import numpy as np

from pdsim.core.config import RequestSpec
from pdsim.core.workload_rules import WorkloadError


@attrs.frozen
class SessionSpec:
    sessions: int
    turns: int = 4
    system: int = 0  # tokens of the system prompt every session starts with
    user: tuple[int, int] = (64, 256)  # a turn's new user tokens, uniform in [A, B]
    output: tuple[int, int] = (64, 256)  # a turn's answer tokens, uniform in [A, B]
    think_s: float = 1.0  # mean think time between an answer and the next turn
    rate: float | None = None  # session starts per second (Poisson); None: `interval`
    interval: float = 0.0  # between session starts (0: all at once)
    seed: int = 0

    def check(self) -> None:
        """Each field within its rule: a WorkloadError naming the option."""
        for name, value in (("--sessions", self.sessions), ("--turns", self.turns)):
            if value < 1:
                raise WorkloadError(f"{name} must be >= 1, got {value}")
        if self.system < 0:
            raise WorkloadError(f"--system-prompt must be >= 0 tokens, got {self.system}")
        for name, (lo, hi), least in (("--turn-tokens", self.user, 1),
                                      ("--output-range", self.output, 0)):
            if not least <= lo <= hi:
                raise WorkloadError(f"{name} must be A:B with {least} <= A <= B, got {lo}:{hi}")
        if not self.think_s >= 0:
            raise WorkloadError(f"--think must be >= 0 s, got {self.think_s}")
        if self.rate is not None and not self.rate > 0:
            raise WorkloadError(f"--rate must be > 0 sessions/s, got {self.rate}")
        if not self.interval >= 0:
            raise WorkloadError(f"--interval must be >= 0 s, got {self.interval}")


class SessionWorkload:
    """The turns of a SessionSpec: first turns by iteration, the rest as `followups`."""

    def __init__(self, spec: SessionSpec) -> None:
        spec.check()
        rng = np.random.default_rng(spec.seed)
        n, turns = spec.sessions, spec.turns
        user = rng.integers(spec.user[0], spec.user[1] + 1, size=(n, turns))
        output = rng.integers(spec.output[0], spec.output[1] + 1, size=(n, turns))
        think = rng.exponential(spec.think_s, size=(n, turns)) if spec.think_s else \
            np.zeros((n, turns))
        if spec.rate is not None:
            starts = np.cumsum(rng.exponential(1.0 / spec.rate, size=n))
        else:
            starts = np.arange(n) * spec.interval
        self.first: list[RequestSpec] = []
        self.followups: dict[str, tuple[float, RequestSpec]] = {}
        self.turns: list[RequestSpec] = []
        for s in range(n):
            history, before = spec.system, None
            for k in range(turns):
                prompt = history + int(user[s, k])
                turn = RequestSpec(f"s{s}t{k}", float(starts[s]) if k == 0 else 0.0, prompt,
                                   0, int(output[s, k]), f"s{s}", spec.system)
                self.turns.append(turn)
                if before is None:
                    self.first.append(turn)
                else:
                    self.followups[before.req] = (float(think[s, k]), turn)
                history, before = prompt + int(output[s, k]), turn
        self.first.sort(key=lambda r: r.arrival)

    def __iter__(self):
        return iter(self.first)

    def __len__(self) -> int:
        return len(self.turns)

    def all_turns(self) -> list[RequestSpec]:
        return list(self.turns)
