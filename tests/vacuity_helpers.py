"""Counting a property's examples that tested nothing (returned before asserting), so that a
module can fail when most of a property's examples were vacuous.

Use: `VACUOUS = Vacuity()` in the module, `VACUOUS.tally(name, tested=...)` in each example,
and a module-scoped autouse fixture that yields and then calls `VACUOUS.check()`."""

from __future__ import annotations

from collections import Counter

from hypothesis import event
from hypothesis.control import currently_in_test_context


class Vacuity:
    """Per property: how many examples ran and how many of them tested nothing."""

    def __init__(self, limit: float = 0.5) -> None:
        self.limit = limit
        self.runs: Counter[str] = Counter()
        self.empty: Counter[str] = Counter()

    def tally(self, name: str, tested: bool) -> bool:
        """Count one example of `name`; returns `tested` so a test can `if not ...: return`."""
        self.runs[name] += 1
        if not tested:
            self.empty[name] += 1
            if currently_in_test_context():
                event("vacuous: tested nothing")  # shown by --hypothesis-show-statistics
        return tested

    def vacuous(self, name: str) -> None:
        """Count one example of `name` that tested nothing (`return VACUOUS.vacuous(name)`)."""
        self.tally(name, False)

    def rates(self) -> dict[str, float]:
        """Share of each property's examples that tested nothing."""
        return {name: self.empty[name] / n for name, n in sorted(self.runs.items())}

    def check(self) -> None:
        """Fail when a property's examples were mostly vacuous (over `limit` of them)."""
        bad = {name: rate for name, rate in self.rates().items() if rate > self.limit}
        assert not bad, ("properties whose examples mostly tested nothing: "
                         + ", ".join(f"{name} {rate:.0%}" for name, rate in bad.items()))
