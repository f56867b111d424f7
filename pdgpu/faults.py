"""Fault injection: every switch that breaks the engine or the protocol on purpose, in one
object the engine consults at fixed points (no switch lives in the engine's loop itself).

`fail_span` makes one copy fail halfway (a legal failure: fail, fence, abort, retry). Each
debug break does what a buggy engine would, through the same resource calls a correct one
uses, so the live check must refuse it with its code (DEBUG_BREAKS).
"""

from __future__ import annotations

import attrs

# Debug switches that break the protocol on purpose, and the code the live check must give.
DEBUG_BREAKS = {
    "issue-early": "COPY-1",  # issue a step's spans before computing it (no readiness)
    "skip-block": "COPY-2",  # issue without waiting for a free slot under max_pending
    "early-reuse": "COPY-3",  # free the source pages while spans still read them
    "double-land": "REQ-1",  # land a span twice
    "admit-early": "ADM-1",  # admit right after produced, spans still in flight
}


@attrs.frozen
class Faults:
    """What to break in a run: nothing by default."""

    fail_span: int | None = None  # the copy of this span id fails halfway
    debug: str | None = None  # one of DEBUG_BREAKS

    def fails(self, span: int) -> bool:
        return span == self.fail_span

    @property
    def issues_before_compute(self) -> bool:
        return self.debug == "issue-early"

    @property
    def skips_block(self) -> bool:
        return self.debug == "skip-block"

    def after_issue(self, ledger, life) -> None:
        if self.debug == "early-reuse":
            ledger.free_source(life)

    def after_land(self, ledger, req: str, span: int) -> None:
        if self.debug == "double-land":
            ledger.land(req, span)

    def after_produced(self, ledger, req: str) -> None:
        if self.debug == "admit-early":
            ledger.admit(req)
