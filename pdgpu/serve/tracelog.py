"""The run's trace, written while it runs, under the name given: at every moment the file is
a prefix of the run's trace (a header, then whole lines, legal under `pdref check --open`),
and a run that ended, however it ended, leaves it closed and legal as a complete trace.

A long run keeps no event in memory but a short reordering window (a 10,000-request soak made
hundreds of thousands of events). Protocol events come in time order. A `stage` is reported
once it ended and carries its start as `t`, so it may come after protocol events later than
its start; every event waits in a heap until the run clock is `window_s` past it (one second:
the file is never more than that, plus one turn of the decoder's loop, behind the run), then
leaves it in time order (protocol order kept among equal times). The loop calls `release`
at every turn, so an idle server's last events are written too. A stage older than what was
already written (it lasted, or was reported, longer than the window after its start) is
written at the last written time and counted (`stages_clamped`): a stage is informational
and the trace must stay ordered (TRACE-2).

Each line goes out in one write as soon as it leaves the heap (line-buffered), so a reader
sees whole lines; the only half line it can ever meet is the last one, in the microseconds
of its write (`pdref check --open` leaves a last line without its newline aside). The file
is created holding the header alone (written beside it and renamed: never empty); the
header may be replaced (`set_header`, the same way) until the first event, once the run knows
what it only learns while starting (the lanes its producers agreed). Without a path the
trace goes to a temporary file, removed by `discard`; `remove` deletes a run's trace that
never started (refused: bad input leaves nothing). `protocol()` reads the protocol events
back for the run's metrics.
"""

from __future__ import annotations

import heapq
import itertools
import os
import tempfile
from pathlib import Path

import attrs

from pdref import events as ev
from pdref.outfile import write_atomic
from pdref.trace import dumps, read_trace

WINDOW_S = 1.0


class TraceLog:
    def __init__(self, header: ev.Header, path: str | Path | None,
                 window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.temporary = path is None
        if path is None:
            fd, path = tempfile.mkstemp(prefix="pdgpu-serve-", suffix=".jsonl")
            os.close(fd)
        self.path = Path(path)
        self.file = None
        self.set_header(header)
        self.heap: list = []
        self.order = itertools.count()
        self.last_written = 0.0
        self.events_written = 0
        self.stages_clamped = 0
        self.closed = False

    def set_header(self, header: ev.Header) -> None:
        """Put `header` in place as the file's whole content (before the first event only)."""
        if self.file is not None and self.events_written:
            raise RuntimeError("the header can only change before the first event")
        if self.file is not None:
            self.file.close()
        self.header = header
        write_atomic(self.path, dumps(ev.header_to_json(header)) + "\n")
        self.file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def add(self, event, now: float | None = None) -> None:
        """Queue `event`; write what the run clock `now` (default: this event's time) left
        behind the window."""
        heapq.heappush(self.heap, (event.t, next(self.order), event))
        self.release(event.t if now is None else now)

    def release(self, now: float) -> None:
        """Write every queued event at least `window_s` older than `now`."""
        while self.heap and self.heap[0][0] <= now - self.window_s:
            self._write(heapq.heappop(self.heap)[2])

    def _write(self, event) -> None:
        if event.t < self.last_written:  # a stage longer than the window
            self.stages_clamped += 1
            event = attrs.evolve(event, t=self.last_written,
                                 end=max(event.end, self.last_written))
        self.last_written = event.t
        self.file.write(dumps(ev.event_to_json(event)) + "\n")
        self.events_written += 1

    def close(self) -> None:
        """Write what waits and close the file (complete from here on)."""
        if self.closed:
            return
        self.closed = True
        while self.heap:
            self._write(heapq.heappop(self.heap)[2])
        self.file.close()

    def protocol(self):
        """The protocol events of the closed trace, read back (stages skipped)."""
        for _, item in read_trace(self.path):
            if isinstance(item, ev.Header) or type(item) is ev.Stage:
                continue
            yield item

    def discard(self) -> None:
        """Remove a temporary trace once its metrics were read."""
        if self.temporary:
            self.path.unlink(missing_ok=True)

    def remove(self) -> None:
        """A run refused before it served (bad input, exit 2): no trace is left."""
        self.closed = True
        self.file.close()
        self.path.unlink(missing_ok=True)
