"""The bridge between the HTTP front end (another thread) and the decoder loop (issue 25).

The HTTP side calls `submit` (token ids, max tokens, stop tokens) and gets a `Handle`; the
decoder loop calls `pump` once a turn, in its own thread, and only there are requests and the
decoder's state touched: new submissions arrive (`Decoder.arrive`), every handle gets the
tokens its request produced since the last turn (the first at admission, then one per decode
step) and, once, its end; a handle whose client went away is cancelled through the decoder's
own cancel path (`Decoder.cancel`: fences, pages back; the trace shows `abort`).
Events go out through the handle's `sink`, a callable the HTTP side gives (it hands them to
its event loop with `call_soon_threadsafe`), so this module knows no asyncio.

Overload: at most `bound` requests are in the system (submitted and not ended); `submit`
refuses more with `Full` (HTTP 429) instead of queueing without limit. `close` starts the
drain: `submit` refuses with `Closed` (HTTP 503), requests in flight finish, those still
running `drain_s` seconds later are cancelled, and `serving` turns False so the loop ends.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import attrs

from pdgpu.sampling import GREEDY
from pdgpu.serve.lives import Status
from pdgpu.serve.workload import ServeRequest

IDLE_S = 0.002  # the loop's longest idle wait: a submission waits at most this long


class Full(Exception):
    """The bounded queue is full (429)."""


class Closed(Exception):
    """The server is draining or stopped (503)."""


@attrs.frozen
class Event:
    """What a request did since its last event: tokens (with their run-clock times), and its
    end (`ok`, `cancelled`, `failed`) once."""

    tokens: tuple[int, ...] = ()
    status: str | None = None
    reason: str | None = None
    logprobs: tuple = ()  # per token, when the request asks: (logprob, ((token, logprob), ...))
    cached: int = 0  # with the end: prompt tokens its producer found in its prefix cache


@attrs.define(eq=False)
class Handle:
    req: str
    request: ServeRequest
    stop: frozenset[int]
    sink: object  # callable(Event), called from the decoder thread
    cancelled: bool = False  # set by the HTTP thread: the client went away
    finished: bool = False  # set by the HTTP thread: a stop string ended it
    tracked: object = None  # the decoder's Tracked, once it arrived
    sent: int = 0  # tokens handed to the sink so far
    asked: bool = False  # the cancel or early finish was passed to the decoder
    admitted: bool = False  # its admission was counted (the handoff histogram)


class Frontend:
    def __init__(self, bound: int, drain_s: float, metrics=None, idle_s: float = IDLE_S) -> None:
        self.bound, self.drain_s, self.metrics, self.idle_s = bound, drain_s, metrics, idle_s
        self.inbox: queue.SimpleQueue[Handle] = queue.SimpleQueue()
        self.active: dict[str, Handle] = {}  # arrived, not ended (decoder thread only)
        self.lock = threading.Lock()  # submit vs close: nothing is put after the drain began
        self.closing = False
        self.drain_deadline: float | None = None
        self.submitted = self.ended = 0  # each written by one thread only
        self.decoder = None  # set at the first pump: the loop serves
        self._ids = itertools.count()

    # -- the HTTP side ------------------------------------------------------------------------

    def in_system(self) -> int:
        return self.submitted - self.ended

    def submit(self, tokens, max_tokens: int, stop=(), sink=lambda event: None,
               sampling=GREEDY) -> Handle:
        """Queue a request (any thread); Full or Closed when it cannot be taken."""
        with self.lock:
            if self.closing:
                raise Closed("the server is shutting down: no new requests")
            if self.in_system() >= self.bound:
                raise Full(f"{self.bound} requests are in the system (the queue bound)")
            req = f"h{next(self._ids)}"
            request = ServeRequest(req, tokens, max_tokens, sampling)
            handle = Handle(req, request, frozenset(stop), sink)
            self.submitted += 1
            self.inbox.put(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """The client went away (any thread): the loop cancels the request at its next turn."""
        handle.cancelled = True

    def finish(self, handle: Handle) -> None:
        """The client has all it wants (a stop string): the request ends ok at the next turn."""
        handle.finished = True

    def close(self) -> None:
        """Begin the drain (any thread; again: no effect)."""
        with self.lock:
            if not self.closing:
                self.closing = True
                self.drain_deadline = time.monotonic() + self.drain_s

    def serving(self) -> bool:
        """False once the drain began and nothing is queued or in flight (closing is read
        first: after it, nothing more can be put)."""
        return not self.closing or bool(self.active) or not self.inbox.empty()

    # -- the decoder side (its thread) --------------------------------------------------------

    def pump(self, decoder) -> None:
        """One turn: take submissions, pass cancels, send tokens and ends."""
        self.decoder = decoder
        self._take(decoder)
        overdue = self.drain_deadline is not None and time.monotonic() > self.drain_deadline
        for handle in list(self.active.values()):
            if overdue:
                handle.cancelled = True  # the drain's grace is over
            self._serve(decoder, handle)
        if self.metrics is not None:
            self.metrics.sample(decoder, self.in_system())

    def _take(self, decoder) -> None:
        while True:
            try:
                handle = self.inbox.get_nowait()
            except queue.Empty:
                return
            handle.tracked = decoder.arrive(handle.request, handle.stop)
            self.active[handle.req] = handle

    def _serve(self, decoder, handle: Handle) -> None:
        t = handle.tracked
        if not handle.asked and not t.status.final:
            if handle.cancelled:
                handle.asked = True
                decoder.cancel(t.req)  # applied by `watch` (recovery.py) this very turn
            elif handle.finished and t.status is Status.RUNNING:  # else: once admitted
                handle.asked = True
                decoder.finish_early(t)
        new, logprobs = _new_tokens(t, handle.sent)
        if self.metrics is not None:
            self._measure(t, handle, len(new))
        handle.sent += len(new)
        if t.status.final:
            del self.active[handle.req]
            self.ended += 1
            if self.metrics is not None:
                self.metrics.ended(t)
            handle.sink(Event(new, str(t.status), t.reason, logprobs, t.producer_hit))
        elif new:
            handle.sink(Event(new, logprobs=logprobs))

    def _measure(self, t, handle: Handle, new: int) -> None:
        if handle.sent == 0 and new:
            self.metrics.first_token(t)
        if t.admitted_t is not None and not handle.admitted:
            handle.admitted = True
            self.metrics.admitted(t)
            self.metrics.prefix_cache(t)
        self.metrics.later_tokens(t, handle.sent, handle.sent + new)

    def abandon(self, reason: str) -> None:
        """The loop ended (stopped or failed): every request not ended gets its end now
        (call from the decoder's thread once its loop returned)."""
        with self.lock:
            self.closing = True
        while True:
            try:
                handle = self.inbox.get_nowait()
            except queue.Empty:
                break
            self.active[handle.req] = handle
        for handle in self.active.values():
            self.ended += 1
            handle.sink(Event((), "failed", reason))
        self.active.clear()


def _new_tokens(t, sent: int) -> tuple[tuple[int, ...], tuple]:
    """The request's tokens after the first `sent`. The first goes out at `produced`, before
    the request's spans all landed: the producer computed it, greedy, and a retried life
    computes the same one (its prefill is the same computation), as the batch mode's TTFT
    counts it (`produced`); the others come with the decode steps after admission. With them
    their log-probabilities, when the request asks."""
    if sent == 0 and not t.output and t.life is not None and t.life.token is not None:
        return (t.life.token,), () if t.life.logprob is None else (t.life.logprob,)
    return tuple(t.output[sent:]), tuple(t.logprobs[sent:])
