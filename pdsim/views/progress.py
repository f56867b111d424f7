"""`pdsim run`'s progress on stderr for a run that takes a while: requests simulated and
simulated time, shown once the run has taken `DELAY_S` (a short run says nothing). On a
terminal, tqdm's bar (as `pdgpu serve`'s); elsewhere (a log, a pipe), where a bar is one
unreadable line, a plain line every `EVERY_S` seconds. Updated when the run folds what
passed (stream.py: every few thousand requests), never per event."""

from __future__ import annotations

import sys
import time

DELAY_S = 3.0  # a run shorter than this shows no progress
EVERY_S = 10.0  # seconds between lines off a terminal


class RunProgress:
    """Call with (requests ended, simulated seconds); `close()` at the end (a `with`)."""

    def __init__(self, total: int, terminal: bool | None = None) -> None:
        self.total, self.start = total, time.perf_counter()
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.last_line = self.start
        self.bar = None
        if self.terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", delay=DELAY_S, file=sys.stderr,
                            leave=False, desc="pdsim run")

    def __call__(self, done: int, simulated_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"simulated {simulated_s:,.0f} s", refresh=False)
            self.bar.update(done - self.bar.n)
            return
        now = time.perf_counter()
        if now - self.start >= DELAY_S and now - self.last_line >= EVERY_S:
            self.last_line = now
            print(f"pdsim run: {done}/{self.total} requests simulated, {simulated_s:,.0f} s "
                  f"simulated, {now - self.start:.0f} s", file=sys.stderr, flush=True)

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
