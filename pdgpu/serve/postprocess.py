"""The decoder loop's postprocess: every message of every producer becomes its pdref event
through the Ledger (the authority): computed, issue, a span's bytes into its slab (land or
fail), reuse, produced, and (v4, `--prefix-cache`) a producer's `computed` hit, its `cache`
(answered `cached`: whether the trace took it) and `evict`; a complete life is handed to
the decoder's admission once pdref says so; faults are the Recovery part's (recovery.py):
failed lives, cancels, dead producers.

A part of the Decoder (decoder.py) that owns its own state (when a message last came) and is
handed the rest: the ledger, the members, recovery, the decoder's requests and lives, and
its admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pdgpu.serve.ledger import Ledger
from pdgpu.serve.lives import Life, Tracked
from pdgpu.serve.members import HANDSHAKE, Members
from pdgpu.serve.recovery import Recovery, ServeError
from pdgpu.serve.transport import Message
from pdref.violations import Violation


class Postprocess:
    """Producer messages into pdref events (see the module docstring)."""

    def __init__(self, ledger: Ledger, members: Members, recovery: Recovery,
                 tracked: dict[str, Tracked], lives: dict[str, Life], verify: bool,
                 admit: Callable[[Tracked], None]) -> None:
        self.ledger, self.members, self.recovery = ledger, members, recovery
        self.tracked, self.lives, self.verify, self.admit = tracked, lives, verify, admit
        self.last_message = time.perf_counter()

    def drain(self) -> None:
        """Every message waiting now."""
        while (msg := self.members.transport.get(timeout=0)) is not None:
            self.handle(msg)

    def handle(self, msg: Message) -> None:
        try:
            self._take(msg)
        finally:  # its tensors were copied out (or dropped): shared slots go back
            self.members.transport.done(msg)

    def _take(self, msg: Message) -> None:
        self.last_message = time.perf_counter()
        self.members.seen(msg.src)
        if msg.op in HANDSHAKE:
            self.members.on_handshake(msg)
        elif msg.op == "lost":
            self.recovery.producer_lost(msg.src, msg.body["error"])
        elif msg.op == "error":
            raise ServeError(f"producer p{msg.src}: {msg.body['message']}")
        elif msg.op == "evict":  # its cache's room: whatever the state of the life it is for
            self.ledger.evict(msg.body["req"], msg.body["pages"], f"p{msg.src}")
        elif msg.op != "beat":
            self._life_message(msg)

    def _life_message(self, msg: Message) -> None:
        life = self.lives.get(msg.body.get("handle"))
        if life is None:
            raise ServeError(f"producer p{msg.src} sent {msg.op!r} for an unknown request life "
                             f"{msg.body.get('handle')!r}")
        t = self.tracked[life.req]
        current = t.life is life and not life.ended
        try:
            getattr(self, f"_on_{msg.op}")(life, msg)
        except Violation as e:  # the live check refused what this message did
            if self.ledger.live.found(e):  # an earlier event's, found by the audit
                raise
            raise Violation(e.code, f"{e.message} (on producer p{msg.src}'s {msg.op!r})",
                            e.event, e.line) from None
        self._settle(life)
        if current and not t.status.final:
            self.recovery.step(t)

    def _on_computed(self, life: Life, msg: Message) -> None:
        if not life.ended:
            b = msg.body
            self.ledger.computed(life.req, b["layers"], b["tokens"], b.get("hit"))
            if "start" in b:  # (a cache hit computes nothing)
                self._stage(life, msg, "compute", b["start"], b["end"])
            if b.get("hit"):
                life.producer_hit = b["tokens"][1]

    def _on_cache(self, life: Life, msg: Message) -> None:
        """The producer put the life's computed pages into its cache: in the trace while the
        life is live; the producer hears whether it is (until then it hits none of them)."""
        b = msg.body
        if not life.ended:
            self.ledger.cache(life.req, b["tokens"], b["pages"], f"p{msg.src}")
        self.members.send(msg.src, "cached", {"handle": life.handle, "recorded": not life.ended})

    def _on_issue(self, life: Life, msg: Message) -> None:
        b = msg.body
        if life.ended or life.failed is not None:
            life.spans[b["sid"]] = None  # a ghost: pdref never sees it, its bytes are dropped
            return
        span = self.ledger.issue(life.req, b["layers"], b["tokens"], b["bytes"],
                                 b.get("state", False))
        life.spans[b["sid"]] = span
        self.recovery.issued(span, life)

    def _on_span(self, life: Life, msg: Message) -> None:
        """A span's bytes (or its writer's failure): land, fail, or dropped when late."""
        span = life.spans.pop(msg.body["sid"])
        self.members.send(msg.src, "ack", {"handle": life.handle})  # the writer's slot
        if span is None:
            return
        self.recovery.arrived(span)
        if span in life.unfenced:  # failed or cancelled before its bytes came: dropped
            life.unfenced.discard(span)
            self.ledger.fence(life.req, span)
            return
        error = msg.body.get("error")
        if error is not None:
            self.ledger.fail(life.req, span, error)
            self.ledger.fence(life.req, span)  # the writer reported it and stopped
        else:
            landing = time.perf_counter()
            error = self.ledger.land(life.req, span, *self._payload(msg))
            self._stage(life, msg, "gather", *msg.body["gather"], span=span)
            self._stage(life, msg, "link", *self._crossed(msg, landing), span=span)
        if error is not None:
            self.recovery.fail_life(life, error)

    def _payload(self, msg: Message) -> tuple:
        """A span's tensors for `Ledger.land`: its bytes, each followed by its digests, or
        by None when the run does not `--verify`."""
        return tuple(t if i % 2 == 0 or self.verify else None
                     for i, t in enumerate(msg.tensors))

    def _crossed(self, msg: Message, landing: float) -> tuple[float, float]:
        """The span's `link` stage on the producer's clock: from its gather to its send, or
        (NIXL: the bytes crossed in `land`, READ by this process) the `land` call itself."""
        if all(isinstance(t, torch.Tensor) for t in msg.tensors):
            return tuple(msg.body["link"])
        offset = self.members.offset(msg.src)
        return landing - offset, time.perf_counter() - offset

    def _on_stopped(self, life: Life, msg: Message) -> None:
        self.recovery.on_stopped(life, msg)

    def _on_reuse(self, life: Life, msg: Message) -> None:
        """The producer gave the life's source pages back on its own (producer.give_back):
        its `reuse`, checked now (COPY-3 while a span reads those tokens; a span issued from
        them later is COPY-1)."""
        if life.ended and msg.body.get("below"):  # [0, prefix): the abort let go of them
            return
        if life.ended:
            raise ServeError(f"producer p{msg.src} gave back the source pages of "
                             f"{life.handle!r} after its life ended, before the decoder's reuse")
        self.ledger.reuse(life.req, tuple(msg.body["tokens"]))

    def _on_produced(self, life: Life, msg: Message) -> None:
        if not life.ended:
            self.ledger.produced(life.req, msg.body["token"])
            self._stage(life, msg, "head", msg.body["start"], msg.body["end"])
            life.token, life.produced_t = msg.body["token"], self.ledger.now()
            self.tracked[life.req].producer_hit = life.producer_hit
            life.logprob = msg.body.get("logprob")  # [logprob, [[token, logprob], ...]]

    def _stage(self, life: Life, msg: Message, name: str, start, end, span=None) -> None:
        offset = self.members.offset(msg.src)
        self.ledger.stage(life.req, name, self.ledger.trace_time(start + offset),
                          self.ledger.trace_time(end + offset), span, f"p{msg.src}")

    def _settle(self, life: Life) -> None:
        """After a message: admit a complete life, end a failed one whose writer stopped,
        forget an ended one whose writer stopped."""
        if life.ended:
            if life.stopped:
                self.recovery.forget(life)
        elif life.failed is not None:
            if life.stopped:
                self.recovery.end_failed(life, source_held=True)
        elif life.produced and self.ledger.can_admit(life.req):
            self.admit(self.tracked[life.req])
