"""The run's trace, written while it runs: a long run keeps no event in memory but a short
reordering window (a 10,000-request soak made hundreds of thousands of events).

Protocol events come in time order. A `stage` is reported once it ended and carries its start
as `t`, so it may come after protocol events later than its start; every event waits in a heap
for `window_s` seconds of trace time and leaves it in time order (protocol order kept among
equal times). A stage older than what was already written (it lasted longer than the window)
is written at the last written time and counted (`stages_clamped`): a stage is informational
and the trace must stay ordered (TRACE-2). The file is written beside its path and renamed
into place at `close` (pdref.trace.TraceWriter); without a path it goes to a temporary file,
removed by `discard`. `protocol()` reads the protocol events back for the run's metrics.
"""

from __future__ import annotations

import heapq
import itertools
import os
import tempfile
from pathlib import Path

import attrs

from pdref import events as ev
from pdref.trace import TraceWriter, read_trace


class TraceLog:
    def __init__(self, header: ev.Header, path: str | Path | None, window_s: float = 10.0):
        self.header, self.window_s = header, window_s
        self.temporary = path is None
        if path is None:
            fd, path = tempfile.mkstemp(prefix="pdgpu-serve-", suffix=".jsonl")
            os.close(fd)
        self.path = Path(path)
        self.writer = TraceWriter(self.path, header).__enter__()
        self.heap: list = []
        self.order = itertools.count()
        self.newest = 0.0
        self.last_written = 0.0
        self.stages_clamped = 0
        self.closed = False

    def add(self, event) -> None:
        heapq.heappush(self.heap, (event.t, next(self.order), event))
        self.newest = max(self.newest, event.t)
        while self.heap and self.heap[0][0] <= self.newest - self.window_s:
            self._write(heapq.heappop(self.heap)[2])

    def _write(self, event) -> None:
        if event.t < self.last_written:  # a stage longer than the window
            self.stages_clamped += 1
            event = attrs.evolve(event, t=self.last_written,
                                 end=max(event.end, self.last_written))
        self.last_written = event.t
        self.writer.write(event)

    def close(self) -> None:
        """Write what waits and put the file in place."""
        if self.closed:
            return
        self.closed = True
        while self.heap:
            self._write(heapq.heappop(self.heap)[2])
        self.writer.__exit__(None, None, None)

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
