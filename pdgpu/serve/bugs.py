"""The hand-made copy bugs of `pdgpu serve --debug` (named in config.DEBUG_BUGS): each is one object
a producer is given at construction and calls at fixed hook points. `NoBug`'s hooks change
nothing, so a correct producer's compute and copy paths hold no debug switch at all.

The hooks, in the order a life meets them:
- `before_compute(producer, job, step)`: before a step (a chunk, or a layer) is computed;
- `queue(outbox, item)`: a span `(job, region)` is handed to the sender thread;
- `flush(outbox)`: after each compute and on a cancel (spans held back start here);
- `after_produced(producer, job)`: the life's first token was sent;
- `after_gather(kv)`: a span's rows `[nl, 2, nt, KVH, D]` were gathered, before they are sent.
"""

from __future__ import annotations

import attrs

from pdref.events import Mode
from pdref.plan import Region


class NoBug:
    """A correct producer: every hook leaves things as they are."""

    def before_compute(self, producer, job, step) -> None:
        return None

    def queue(self, outbox, item) -> None:
        outbox.put(item)  # the copy starts as soon as the sender takes it

    def flush(self, outbox) -> None:
        return None

    def after_produced(self, producer, job) -> None:
        return None

    def after_gather(self, kv) -> None:
        return None


NO_BUG = NoBug()  # stateless: one is enough for every producer


class DropLastRow(NoBug):
    """The copy loses each span's last token row (only --verify can see it)."""

    def after_gather(self, kv) -> None:
        if kv.shape[2]:
            kv[:, :, -1] = 0  # [nl, 2, KVH, D]


@attrs.define
class EarlyReuse(NoBug):
    """The source design's consumer source-reuse bug: a life's source pages are given back
    at `produced`, while its last spans are still to be copied. Each span starts one step
    late (at the flush after the one following its queueing), so at `produced` the last
    step's span (every span, in whole mode) still waits, and it is gathered from pages the
    next prefill may have overwritten. The give-back goes through the producer's one door,
    `give_back`, which announces it as `reuse`: the decoder's live check stops the run
    (COPY-3 while a span reads those tokens, COPY-1 for the span issued after)."""

    held: list = attrs.Factory(list)  # spans queued since the last flush
    late: list = attrs.Factory(list)  # spans the next flush starts

    def queue(self, outbox, item) -> None:
        self.held.append(item)

    def flush(self, outbox) -> None:
        for item in self.late:
            outbox.put(item)
        self.late, self.held = self.held, []

    def after_produced(self, producer, job) -> None:
        producer.give_back(job)


class IssueEarly(NoBug):
    """A streamed span is announced before its step is computed (the live check: COPY-1)."""

    def before_compute(self, producer, job, step) -> None:
        mode = producer.config.mode
        if mode is Mode.WHOLE:
            return
        region = Region((step, step + 1), (job.prefix, job.prompt)) if mode is Mode.LAYER \
            else Region((0, producer.geometry.layers), step)
        producer._send("issue", handle=job.handle, sid=next(producer.sids),
                       layers=region.layers, tokens=region.tokens,
                       bytes=region.bytes(producer.geometry))


BUGS = {"drop-last-row": DropLastRow, "early-reuse": EarlyReuse, "issue-early": IssueEarly}


def bug_for(name: str | None) -> NoBug:
    """A fresh object for `--debug NAME` (None: no bug); ValueError for an unknown name."""
    if name is None:
        return NO_BUG
    if name not in BUGS:
        raise ValueError(f"debug: unknown bug {name!r} (known: {', '.join(BUGS)})")
    return BUGS[name]()
