"""What `pdgpu serve` says on stderr while it serves: one line per producer death, restart and
rejoin, and its progress (tqdm's bar on a terminal; elsewhere, where a bar is one unreadable
line or nothing at all, a plain line every `--progress-every` seconds)."""

from __future__ import annotations

import sys
import threading
import time

PREFIX = "pdgpu serve: "


def say(text: str) -> None:
    """One line on stderr, above tqdm's bar when there is one (so the bar stays whole)."""
    from tqdm import tqdm

    tqdm.write(PREFIX + text, file=sys.stderr)


class LineProgress:
    """tqdm's `update`/`close` for stderr that is not a terminal: a thread prints the line
    every `every_s` seconds, so a run that stalls still says so, not only one that finishes."""

    def __init__(self, total: int, run, every_s: float) -> None:
        self.total, self.run, self.done = total, run, 0
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(every_s,), daemon=True,
                                        name="pdgpu-progress")
        self._thread.start()

    def update(self, n: int = 1) -> None:
        self.done += n

    def line(self) -> str:
        """Requests done of all, tokens made so far and their rate since serving began."""
        decoder, ledger = self.run.decoder, self.run.ledger
        if decoder is None or ledger is None:  # still starting: rendezvous, models
            return f"{self.done}/{self.total} requests done (starting, " \
                   f"{time.perf_counter() - self.start:.0f} s)"
        tokens = sum(len(t.output) for t in list(decoder.tracked.values()))
        serving_s = max(ledger.now(), 1e-9)
        return f"{self.done}/{self.total} requests done, {tokens} tokens, " \
               f"{tokens / serving_s:.1f} tokens/s over {serving_s:.1f} s"

    def _loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            say(self.line())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def progress(wanted: bool | None, every_s: float, total: int, run):
    """tqdm's bar on a terminal; elsewhere (a log, a pipe) a line every `every_s` seconds;
    `wanted` False (--no-progress): neither."""
    if wanted is None and not sys.stderr.isatty():
        return LineProgress(total, run, every_s)
    from tqdm import tqdm

    return tqdm(total=total, unit="req", disable=wanted is False, file=sys.stderr,
                leave=False, desc="pdgpu serve")
