"""What the decoder does when something goes wrong (issue 10): `Recovery`, a part of the
`Decoder` (decoder.py) that owns the state only faults need (span deadlines, the producer
kills to come, cancels from other threads) and is handed, explicitly, the decoder's book of
requests and lives and the two ways a request leaves it (`finish`, `leave_batch`).

- A span fails (its writer reports it, `--verify` finds altered bytes, or its deadline
  `--span-timeout` passes): `fail`; the life is never admitted; the producer is told to
  cancel the life. When it answers `stopped` (its sender passed every span of the life, so
  nothing more can come), every span still unfenced gets its `fence`, the source is given back
  (`reuse`), the life is `abort`ed and the request retried as a new life, up to
  `--max-attempts` lives, else it ends `failed` with the reason.
- A cancel (`cancel(req)`, from any thread, or `--cancel-rate`) ends the request in any
  phase: a queued one leaves the queue; a live one is `abort`ed at once with its spans in
  flight, whose pages stay quarantined until each writer is fenced (its late bytes arrive and
  are dropped, or the producer says `stopped`); a decoding one is aborted, pages back.
- A producer declared dead (members.py): its link is torn down and its process stopped, so
  its spans in flight `fail` and every unfenced span of its lives is fenced at once; its live
  lives are aborted and retried on the others.
The pages of the decoder's pool only ever come back through pdref's events (`abort`,
`fence`, `release`), so the pool is pdref's own and never ahead of it.
"""

from __future__ import annotations

import queue
from collections import deque

from pdgpu.serve.lives import Life, Status, Tracked
from pdref.events import Mode
from pdref.plan import plan_chunks, plan_spans


class ServeError(RuntimeError):
    """The run cannot go on (a producer error, no progress); one line."""


def expected_steps(header, request, prefix: int) -> int:
    """Messages and decoded tokens of a fault-free life: the span of `--cancel-rate` draws."""
    chunk = dict(header.extra)["chunk"]
    chunks = plan_chunks(request.prompt, prefix, chunk)
    spans = plan_spans(header.mode, header.geometry, request.prompt, prefix, chunk)
    computed = header.geometry.layers if header.mode is Mode.LAYER and chunks else len(chunks)
    return computed + 2 * len(spans) + 1 + request.output_tokens - 1


class Recovery:
    def __init__(self, ledger, members, policy, tracked: dict[str, Tracked],
                 waiting: deque, lives: dict[str, Life], finish, leave_batch) -> None:
        self.ledger, self.members, self.policy = ledger, members, policy
        self.tracked, self.waiting, self.lives = tracked, waiting, lives  # the decoder's
        self.finish, self.leave_batch = finish, leave_batch  # Decoder._finish, _leave_batch
        self.deadlines: dict[int, tuple[float, Life]] = {}  # span -> (deadline, its life)
        self.kills = sorted(policy.kills, key=lambda k: k.t)
        self.cancels: queue.SimpleQueue = queue.SimpleQueue()  # cancel() from any thread

    # -- the serving API ----------------------------------------------------------------------

    def cancel(self, req: str) -> None:
        """Cancel request `req` (thread-safe: applied by the loop at its next turn)."""
        if req not in self.tracked:
            raise KeyError(f"no request {req!r} in this run")
        self.cancels.put(req)

    # -- span deadlines (`--span-timeout`) ----------------------------------------------------

    def issued(self, span: int, life: Life) -> None:
        """A span of `life` was issued: it must land within the span timeout (if any)."""
        if self.policy.span_timeout is not None:
            self.deadlines[span] = (self.ledger.now() + self.policy.span_timeout, life)

    def arrived(self, span: int) -> None:
        """A span's bytes (or its writer's failure) came: no deadline any more."""
        self.deadlines.pop(span, None)

    # -- checks at every turn of the loop -----------------------------------------------------

    def watch(self) -> None:
        self.ledger.raise_audit_error()  # a violation the audit found stops the run here
        self.ledger.write_trace()
        while not self.cancels.empty():
            self._cancel(self.tracked[self.cancels.get()])
        now = self.ledger.now()
        while self.kills and self.kills[0].t <= now:
            self.members.kill(self.kills.pop(0).producer)
        for rank, reason in self.members.due_deaths().items():
            self.producer_lost(rank, reason)
        for span, (deadline, life) in list(self.deadlines.items()):
            if deadline <= now and span in self.deadlines:
                self._timed_out(life, span)
        if self.waiting and not self.members.can_serve():
            while self.waiting:
                t = self.waiting.popleft()
                self.finish(t, Status.FAILED, f"no producer left ({t.attempts} attempts)")

    def _timed_out(self, life: Life, span: int) -> None:
        del self.deadlines[span]
        reason = f"span {span} not landed within {self.policy.span_timeout:g} s"
        self.ledger.fail(life.req, span, reason)
        life.unfenced.add(span)  # its writer may still be busy: fenced when it stops
        self.fail_life(life, reason)

    def step(self, t: Tracked, count: int = 1) -> None:
        """The request made `count` steps; a drawn cancel comes when they reach its point."""
        t.steps += count
        if t.cancel_at is not None and t.steps >= t.cancel_at and not t.status.final:
            self._cancel(t)

    # -- cancels ------------------------------------------------------------------------------

    def _cancel(self, t: Tracked) -> None:
        if t.status.final:
            return
        if t.status is Status.WAITING:
            if t in self.waiting:
                self.waiting.remove(t)
        elif t.status is Status.RUNNING:
            self.ledger.abort(t.req, "cancelled")
            self.leave_batch(t)
        else:
            self._abort_life(t.life, "cancelled")
        t.life = None
        self.finish(t, Status.CANCELLED, "cancelled")

    # -- failures -----------------------------------------------------------------------------

    def fail_life(self, life: Life, reason: str) -> None:
        """The life can no longer be admitted: its producer is told to stop it."""
        if life.failed is None:
            life.failed = reason
        self._send_cancel(life)

    def _send_cancel(self, life: Life) -> None:
        if not life.cancel_sent:
            life.cancel_sent = True
            self.members.send(life.producer, "cancel", {"handle": life.handle})

    def _abort_life(self, life: Life, reason: str) -> None:
        """`abort` now: spans in flight are cancelled (unfenced until their writer stops)."""
        for span in life.spans.values():
            if span is not None and span not in life.unfenced:
                life.unfenced.add(span)
                self.deadlines.pop(span, None)
        self.ledger.abort(life.req, reason)
        life.ended = True
        self._send_cancel(life)
        if life.stopped:
            self.forget(life)

    def end_failed(self, life: Life, source_held: bool) -> None:
        """A failed life whose writers all stopped: source back, abort, retry or fail."""
        t = self.tracked[life.req]
        if source_held:
            self.ledger.reuse(t.req, (life.prefix, t.request.prompt))
        self._abort_life(life, life.failed)
        t.life = None
        if t.attempts >= self.policy.max_attempts:
            self.finish(t, Status.FAILED, f"{life.failed} ({t.attempts} attempts)")
        elif not self.members.can_serve():
            self.finish(t, Status.FAILED, f"{life.failed}; no producer left")
        else:
            t.status = Status.WAITING
            self.waiting.appendleft(t)  # keeps its place: the oldest request

    def on_stopped(self, life: Life, msg) -> None:
        """The producer passed every span of the life: what never came is fenced now, and
        the slots of those writers go back."""
        life.stopped = True
        if life.spans:
            self.members.send(msg.src, "ack", {"handle": life.handle, "slots": len(life.spans)})
        self._fence_all(life, f"cancelled: {life.failed or 'life ended'}")

    def _fence_all(self, life: Life, error: str) -> None:
        """No writer of this life can write any more: fail what is in flight, fence all."""
        for span in life.spans.values():
            if span is not None and span not in life.unfenced:
                self.ledger.fail(life.req, span, error)
                life.unfenced.add(span)
            if span is not None:
                self.deadlines.pop(span, None)
        life.spans.clear()
        for span in sorted(life.unfenced):
            self.ledger.fence(life.req, span)
        life.unfenced.clear()

    def forget(self, life: Life) -> None:
        """An ended life its producer stopped: its source pages may go."""
        if self.lives.pop(life.handle, None) is not None:
            self.members.send(life.producer, "reuse", {"handle": life.handle})

    def producer_lost(self, rank: int, reason: str) -> None:
        """Declared dead: its writers stopped for good with its link; its lives end."""
        if not self.members.alive(rank):
            return
        self.members.declare_dead(rank, reason)
        for life in [x for x in self.lives.values() if x.producer == rank]:
            life.stopped = True
            self._fence_all(life, f"producer p{rank} lost")
            del self.lives[life.handle]
            if not life.ended:
                life.failed = life.failed or f"producer p{rank} lost: {reason}"
                life.cancel_sent = True  # nobody to tell
                self.end_failed(life, source_held=False)

    # -- teardown -----------------------------------------------------------------------------

    def cancel_all(self, reason: str) -> None:
        """After the producers are gone (the ledger stopped): abort every live life, fence
        what it left unfenced."""
        for t in self.tracked.values():
            if t.status in (Status.PREFILL, Status.RUNNING):
                self.ledger.abort(t.req, reason)  # cancels its spans in flight
            if not t.status.final:
                t.status, t.reason = Status.CANCELLED, reason
        for life in self.lives.values():
            for span in self.ledger.unfenced(life.req):
                self.ledger.fence(life.req, span)  # the transport is torn down: no writer
