"""What the simulated decode batch did (DecodeRecord): each step's start and end, batch, KV
tokens read and label by runs of steps; the serving metrics read it and the trace writer
adds its steps as the contract's `decode` stages, in time order.
"""

from __future__ import annotations

import attrs

from pdref import events as ev


@attrs.define
class DecodeRecord:
    """What the decode batch did, for the serving metrics and the trace's `decode` stages
    (`stages()`): each step's start and end; batch, KV tokens and label by runs of steps."""

    step_start: list[float] = attrs.Factory(list)
    step_end: list[float] = attrs.Factory(list)
    # (steps, batch, KV tokens of the first, label): that many steps in a row over the same
    # batch, each reading `batch` KV tokens more than the one before, naming the same req
    # (the req a step's stage names: need not be live). Runs are as long as they can be
    # (`add_run`): one record of given steps has one value, however they were run.
    runs: list[tuple[int, int, int, str]] = attrs.Factory(list)
    # req -> (first token time, first decode step, decode steps) of the life that decoded
    tokens: dict[str, tuple[float, int, int]] = attrs.Factory(dict)
    # a run that keeps no record: steps taken out of the lists above (`take_batches`), and
    # the sum of their batches; step indices count them
    drained: int = 0
    drained_batch: int = 0

    @property
    def steps(self) -> int:
        return self.drained + len(self.step_end)

    def take_batches(self, count: int) -> list[int]:
        """The batches of the first `count` steps held, which leave `runs` (their times are
        the caller's to remove)."""
        out: list[int] = []
        runs = self.runs
        while len(out) < count:
            steps, batch, kv, label = runs[0]
            take = min(steps, count - len(out))
            out += [batch] * take
            if take == steps:
                del runs[0]
            else:
                runs[0] = (steps - take, batch, kv + take * batch, label)
        self.drained += count
        self.drained_batch += sum(out)
        return out

    def add_run(self, steps: int, batch: int, kv: int, label: str) -> None:
        """`steps` more steps (their times appended by the caller), joined to the last run
        where they go on from it."""
        if self.runs:
            last_steps, last_batch, first, last_label = self.runs[-1]
            if (batch == last_batch and label == last_label
                    and kv == first + last_steps * batch):
                self.runs[-1] = (last_steps + steps, batch, first, label)
                return
        self.runs.append((steps, batch, kv, label))

    @property
    def batch(self) -> list[int]:
        """Each step's batch (requests decoded together)."""
        return [batch for steps, batch, _, _ in self.runs for _ in range(steps)]

    @property
    def kv_tokens(self) -> list[int]:
        """The KV tokens each step read."""
        return [kv for steps, batch, first, _ in self.runs
                for kv in range(first, first + steps * batch, batch)]

    @property
    def label(self) -> list[str]:
        return [label for steps, _, _, label in self.runs for _ in range(steps)]

    def batch_mean(self) -> float | None:
        """The mean batch over the steps (None without a step)."""
        steps = self.drained + sum(steps for steps, _, _, _ in self.runs)
        batches = self.drained_batch + sum(steps * batch for steps, batch, _, _ in self.runs)
        return batches / steps if steps else None

    def stages(self) -> list[ev.Stage]:
        """Each step as the contract's `decode` stage (batch, KV tokens read), in time order."""
        return [ev.Stage(t, req, "decode", end, None, "decoder", None, batch, kv)
                for t, end, batch, kv, req in zip(self.step_start, self.step_end, self.batch,
                                                  self.kv_tokens, self.label, strict=True)]
