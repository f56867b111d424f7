"""A workload's metrics as running sums and quantiles, folded from its events in parts.

`RunningMetrics` takes a run's protocol events in order, any number at a time (`track`), and
keeps of each ended life only what the metrics need: counts and sums, and its latencies in
`Quantiles` (exact up to a bound, then a sketch with a stated error: quantiles.py). The
simulator feeds it while it runs, so that nothing of a finished request stays; a run that
kept its events is folded the same way at the end (metrics.workload_metrics): one
computation for both. What the events do not say is asked of the caller when a life ends:
the request's arrival (closed loop: when it entered), its first output token's time and its
output tokens (`RequestFacts`).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress

from pdref.events import Fence, Release, Reserve
from pdref.metrics import LifeMetrics, Tracker, track
from pdsim.core.quantiles import EXACT_LIMIT, Quantiles

# req -> (arrival, first output token's time, output tokens) of a request whose life ended ok
RequestFacts = Callable[[str], tuple[float, float, int]]

_POOL_KINDS = frozenset(("reserve", "release", "abort", "fence"))
_POOL_TYPES = frozenset((Reserve, Release, Fence))
_WRITER_KINDS = frozenset(("issue", "land"))


class RunningMetrics:
    """The folded state of a workload's metrics (see the module docstring). `faults`: lives
    may be aborted (pages quarantined until their writers' fences); `keep_ok`: list the reqs
    that ended ok (`ok_reqs`, for a caller that computes more from them); `on_ok`: called
    with each life that ended ok, its arrival and its first token's time."""

    def __init__(self, pool_pages: int, facts: RequestFacts, faults: bool = False,
                 keep_ok: bool = False, exact_limit: int = EXACT_LIMIT,
                 on_ok: Callable[[LifeMetrics, float, float], None] | None = None) -> None:
        self.pool_pages, self.facts, self.faults = pool_pages, facts, faults
        self.on_ok = on_ok
        self.tracker = Tracker(fences=True, on_end=self._ended)
        self.pool = PoolUse()
        self.area = self.last_t = 0.0  # pages held x seconds, up to last_t
        self.fences = self.protocol_events = 0
        self.lives = self.ok = self.bytes = self.spans = self.failed_spans = 0
        self.prompt_tokens = self.generated = 0  # over ok lives: prefilled, generated
        self.makespan = 0.0
        self.ok_reqs: list[str] | None = [] if keep_ok else None
        self.ttft, self.wait, self.tail, self.handoff, self.itl = (
            Quantiles(exact_limit) for _ in range(5))

    def track(self, events) -> None:
        """Fold the next protocol events (or pdref.rows), in the order checked."""
        track(self.tracker, events)
        self._occupy(events)
        self.protocol_events += len(events)

    def _ended(self, life: LifeMetrics) -> None:
        self.lives += 1
        self._sums(life)
        self.makespan = max(self.makespan, life.end_t)
        if life.outcome != "released":
            return
        arrival, first_token, output = self.facts(life.req)
        self.ok += 1
        self.prompt_tokens += life.prompt - life.prefix
        self.generated += output
        self.ttft.add(first_token - arrival)
        self.wait.add(life.reserve_t - arrival)
        self.tail.add(life.ready_t - life.produced_t)
        if life.ready_t is not None:
            self.handoff.add(life.ready_t - life.reserve_t)
        if self.ok_reqs is not None:
            self.ok_reqs.append(life.req)
        if self.on_ok is not None:
            self.on_ok(life, arrival, first_token)

    def _sums(self, life: LifeMetrics) -> None:
        self.bytes += life.bytes
        self.spans += life.spans
        self.failed_spans += life.failed_spans

    def open_lives(self) -> None:
        """Count the lives still open at the end (their bytes and spans; no latency)."""
        for life in self.tracker.live.values():
            self.lives += 1
            self._sums(life)
        self.tracker.live.clear()

    def _occupy(self, events) -> None:
        """Pages held over time: the area under the pool's use, and its peak."""
        pool, area, last_t = self.pool, self.area, self.last_t
        if not self.faults:  # no life is aborted: no page is quarantined, writers never matter
            events = compress(events, map(_POOL_TYPES.__contains__, map(type, events)))
        for e in events:
            kind = e.kind
            if kind in _WRITER_KINDS:
                getattr(pool, kind)(e)
            elif kind in _POOL_KINDS:  # the pages held may change here
                area += pool.used * (e.t - last_t)
                last_t = e.t
                getattr(pool, kind)(e)
                self.fences += kind == "fence"
        self.area, self.last_t = area, last_t

    @property
    def occupancy(self) -> float:
        """Time-averaged fraction of pool pages held (quarantined ones too)."""
        return self.area / (self.last_t * self.pool_pages) if self.last_t > 0 else 0.0

    @property
    def peak_staging(self) -> int:
        return self.tracker.peak_staging


class PoolUse:
    """Pages held by live slabs and by aborted slabs until their last writer's fence."""

    def __init__(self) -> None:
        self.used = self.peak = 0
        self.held: dict[str, int] = {}  # live request -> pages
        self.writers: dict[object, str] = {}  # span not yet landed or fenced -> request
        self.quarantine: dict[str, list[int]] = {}  # req -> [pages, writers left] (per life)
        self.owner: dict[object, str] = {}  # unfenced span of an ended life -> its quarantine

    def reserve(self, e) -> None:
        self.held[e.req] = len(e.pages)
        self.used += len(e.pages)
        self.peak = max(self.peak, self.used)

    def issue(self, e) -> None:
        self.writers[e.span] = e.req

    def land(self, e) -> None:
        self.writers.pop(e.span, None)

    def release(self, e) -> None:
        self.used -= self.held.pop(e.req, 0)

    def abort(self, e) -> None:
        pages = self.held.pop(e.req, 0)
        mine = [s for s, req in self.writers.items() if req == e.req]
        if not mine:
            self.used -= pages
            return
        key = f"{e.req}@{e.t}#{len(self.quarantine)}"
        self.quarantine[key] = [pages, len(mine)]
        for span in mine:
            del self.writers[span]
            self.owner[span] = key

    def fence(self, e) -> None:
        self.writers.pop(e.span, None)  # a failed span of a live life
        key = self.owner.pop(e.span, None)
        if key is None:
            return
        held = self.quarantine[key]
        held[1] -= 1
        if not held[1]:
            self.used -= self.quarantine.pop(key)[0]
