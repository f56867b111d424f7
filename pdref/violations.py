"""Violations of the protocol, each naming the contract code of the rule it breaks."""

from __future__ import annotations

CODES = {
    "TRACE-1": "every line is well-formed",
    "TRACE-2": "t never decreases; a stage has end >= t",
    "CFG-1": "layer mode is refused for a recurrent geometry that names no layer kinds",
    "SLAB-1": "a reservation gets exactly the right free pages, inside the pool",
    "SLAB-2": "prefix is page-aligned and 0 <= prefix <= prompt, prompt >= 1",
    "REQ-1": "events name a live request and a span in flight (fence: unfenced); ids unique",
    "COV-1": "an issued span lies inside [0, L) x [prefix, prompt)",
    "COV-2": "spans never overlap landed tokens or other spans in flight",
    "COV-3": "admit needs every layer covered on [prefix, prompt)",
    "COPY-1": "a span is issued only from computed, not reused, source KV",
    "COPY-2": "a producer never has more than max_pending spans in flight or unfenced",
    "COPY-3": "reuse never touches tokens a span in flight or unfenced reads",
    "COPY-4": "an issued span's bytes equal the KV bytes of its region",
    "PROD-1": "produced comes once, after the whole suffix was computed",
    "ADM-1": "admit comes once, after produced, with no span in flight or failed",
    "LIFE-1": "release only after admit; a complete trace ends with nothing held or unfenced",
    "COPY-5": "a reserve never takes a page that an unfenced writer may still write (v2)",
    "STATE-1": "a state span is issued only once its linear layers consumed the whole prompt (v3)",
    "STATE-2": "a linear layer's state lands once per life (v3)",
    "STATE-3": "admit needs the state of every linear layer landed (v3)",
    "STATE-4": "a state slot is never written or given to another life while its state may "
               "still be read (v3)",
    "SLIDE-1": "a span never moves a sliding layer's KV from outside its window (v3)",
    "CACHE-1": "a cache hit names pages its cache holds, at their token positions (v4)",
    "CACHE-2": "a page enters a cache complete and nothing writes it while cached (v4)",
    "EVICT-1": "an eviction takes only cached pages no life holds and no span reads (v4)",
}


class Violation(Exception):
    """An event (or trace line) that breaks the rule named by `code`."""

    def __init__(
        self, code: str, message: str, event: object | None = None, line: int | None = None
    ) -> None:
        if code not in CODES:
            raise ValueError(f"unknown violation code {code!r}")
        super().__init__(f"{code} {message}")
        self.code = code
        self.message = message
        self.event = event
        self.line = line  # 1-based trace line, when the violation came from a file
